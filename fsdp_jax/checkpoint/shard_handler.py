"""The Orbax item handler that writes a state as raw shard files (`shard_files`).

The Checkpointer's `CheckpointManager` keeps doing what it did for every payload: one
`<step>.orbax-checkpoint-tmp` directory per save, renamed when every process has written
(the atomic commit), retention, the background commit thread and the manifest callback.
This handler only replaces how the `state` item's arrays become files: `async_save` copies
this process's shards to host memory (the only part the caller waits for) and returns a
commit future that writes them (`shard_files.write_shards`); `Streamed` leaves (an nvme run's
layer files) are written there too, by their owner, who keeps their source unchanged until then;
`restore` reads them onto the
target layout (`shard_files.read_tree`).

    ocp.args.Composite(state=ShardSave(state), extras=ocp.args.JsonSave(extras))
"""

from __future__ import annotations

import dataclasses
from typing import Any, List, Optional

from etils import epath
from orbax.checkpoint import args as ocp_args
from orbax.checkpoint import future
from orbax.checkpoint.handlers import AsyncCheckpointHandler

from fsdp_jax.checkpoint import shard_files


class ShardCheckpointHandler(AsyncCheckpointHandler):
    """Saves a pytree of arrays as one file per distinct host shard, plus a JSON index."""

    async def async_save(self, directory: epath.Path, args: "ShardSave") -> Optional[List[future.Future]]:
        pieces, meta = shard_files.host_shards(args.item)  # device-to-host copies, before returning
        target = epath.Path(directory)

        async def write():  # orbax has created `target` by now
            shard_files.write_shards(target, shard_files.write_streamed(target, pieces), meta)

        return [future.CommitFutureAwaitingContractedSignals(write(), name="fsdp_jax_shard_save")]

    def save(self, directory: epath.Path, args: "ShardSave") -> None:
        pieces, meta = shard_files.host_shards(args.item)
        pieces = shard_files.write_streamed(epath.Path(directory), pieces)
        shard_files.write_shards(epath.Path(directory), pieces, meta)

    def restore(self, directory: epath.Path, args: "ShardRestore") -> Any:
        return shard_files.read_tree(epath.Path(directory), args.item)

    def metadata(self, directory: epath.Path) -> dict:
        return shard_files.metadata(epath.Path(directory))

    def finalize(self, directory: epath.Path) -> None:
        pass

    def close(self) -> None:
        pass


@ocp_args.register_with_handler(ShardCheckpointHandler, for_save=True)
@dataclasses.dataclass
class ShardSave(ocp_args.CheckpointArgs):
    item: Any  # a pytree of jax Arrays (any memory kind), numpy arrays or numbers


@ocp_args.register_with_handler(ShardCheckpointHandler, for_restore=True)
@dataclasses.dataclass
class ShardRestore(ocp_args.CheckpointArgs):
    item: Any  # the target: a pytree of ShapeDtypeStructs with shardings
