"""The Checkpointer: asynchronous sharded saves with Orbax, restore onto any mesh.

A checkpoint directory (the trainer uses `<run_dir>/checkpoints`) holds one
directory per step, written by `orbax.checkpoint.CheckpointManager`:

    <step>/state/                  the TrainState: params, optimizer state, step; one raw
                                   file per distinct shard + a JSON index per process
                                   (`shard_files`: each process writes only its own shards,
                                   checksummed as written); `payload="orbax"`: Orbax's OCDBT
    <step>/extras/                 JSON: loop step, data-iterator state, RNG key, config
    <step>/fsdp_jax_manifest.json  the size and CRC-32 of every file above (`manifest`)

`save` returns once the arrays are copied off the devices (offloaded `pinned_host`
arrays are copied host to host); the files are written in the background while
training continues. Steps written with either payload restore. Orbax writes into
`<step>.orbax-checkpoint-tmp` and renames it when every process is done; the
manifest is written just before that rename, so a step directory without one was
not written here (or by an older version) and is restored unverified. A crash
mid-save leaves only the tmp directory, which the next `Checkpointer` reports (see
`partial`) and removes.

Restoring takes the target layout as a tree of `jax.ShapeDtypeStruct`s with
shardings, e.g. `fsdp_jax.train.state.abstract_state(plan, abstract_params, optimizer)`:
the same call restores onto 1 device, 4 devices, a 2x4 `hybrid_shard` mesh or as
`no_shard`; each process reads only the shards it needs. Before reading arrays it
checks the manifest (a truncated, deleted or changed file -> that step is damaged:
the newest earlier step that restores is used instead, and the skipped ones are
reported) and the saved shapes against the target (a mismatch is a `CheckpointError`
naming the paths and shapes, never a fallback).
"""

from __future__ import annotations

import collections
import contextlib
import errno
import os
import shutil
import time
import warnings
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np
import orbax.checkpoint as ocp
from etils import epath
from jax.experimental import multihost_utils

from fsdp_jax.checkpoint import fits, manifest, orbax_logs, shard_files
from fsdp_jax.checkpoint.manifest import ITEMS, MANIFEST, TMP_SUFFIX, tree_paths
from fsdp_jax.checkpoint.shard_handler import ShardSave
from fsdp_jax.errors import CheckpointError, CheckpointWriteError, one_line

PAYLOADS = {"shards": ShardSave, "orbax": ocp.args.StandardSave}  # how `save` writes the arrays
_WRITE_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EACCES, errno.EIO)


class Restored(NamedTuple):
    state: Any  # the restored tree, laid out as the target
    extras: dict  # the JSON saved with it
    step: int  # the checkpoint step restored
    warnings: list  # one line each: damaged steps skipped, unverified steps
    filled: tuple = ()  # paths absent from the checkpoint, created as zeros (`restore`'s fill_missing)


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(f"fsdp_jax:{name}")


class Checkpointer:
    """Async, sharded checkpoints of a state pytree plus JSON extras in `directory`.

        ckpt = Checkpointer(run_dir / "checkpoints", keep=3)
        ckpt.save(step, state, {"data": it.get_state()})    # returns while writing
        restored = ckpt.restore(abstract_state(plan, abstract_params, optimizer))
        ckpt.close()                                         # waits for the writes

    `keep`: the newest `keep` steps are kept. `payload`: how arrays are written, "shards"
    (raw shard files, at the disk's speed) or "orbax" (Orbax's OCDBT). `read_only`: never write or delete
    (safe on a directory a running trainer writes). Every process of a
    multi-process run creates one and calls `save` with the same step; orbax
    coordinates the writes.
    """

    def __init__(
        self,
        directory: str | os.PathLike,
        *,
        keep: int | None = 3,
        async_save: bool = True,
        read_only: bool = False,
        payload: str = "shards",
    ):
        if payload not in PAYLOADS:
            raise ValueError(f"payload: {payload!r} is not one of {', '.join(PAYLOADS)}")
        self.directory = Path(directory).absolute()
        self.payload = payload
        self.async_save = async_save
        self.read_only = read_only
        # Interrupted saves, reported before orbax removes them (when not read_only).
        self.partial: list[Path] = sorted(self.directory.glob(f"*{TMP_SUFFIX}*")) if self.directory.is_dir() else []
        self._in_flight: collections.deque[int] = collections.deque()
        self._pending: int | None = None  # the newest step handed to orbax (every process)
        orbax_logs.install()
        # (not orbax's read_only option: it logs warnings on every use)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=None if read_only else keep,
            create=not read_only,
            cleanup_tmp_directories=not read_only,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._write_manifest),
        )
        self._mngr = ocp.CheckpointManager(self.directory, options=options, item_names=ITEMS)

    # -- saving ---------------------------------------------------------------------------

    def save(self, step: int, state, extras: dict | None = None) -> None:
        """Start writing `state` (any pytree of jax.Arrays) and `extras` (JSON-able) as
        `step`. Returns after the device-to-host copy, so `state` may be donated next;
        waits first for the previous save. A step that already exists is an error."""
        if self.read_only:
            raise ValueError(f"{self.directory}: this Checkpointer is read-only")
        self.wait()  # the previous save's failure is reported as that step's
        if jax.process_index() == 0:
            self._in_flight.append(step)
        self._pending = step
        with self._write_errors():
            try:
                self._mngr.save(
                    step,
                    args=ocp.args.Composite(
                        state=PAYLOADS[self.payload](state), extras=ocp.args.JsonSave(extras or {})
                    ),
                    force=True,
                )
            except BaseException:
                if self._in_flight and self._in_flight[-1] == step:
                    self._in_flight.pop()
                raise
        if not self.async_save:
            self.wait()

    @contextlib.contextmanager
    def _write_errors(self):
        """OS errors of a save (also raised later, from its background thread) ->
        CheckpointWriteError naming the step; bad arguments propagate unchanged."""
        try:
            yield
        except (CheckpointError, CheckpointWriteError, TypeError):
            raise
        except Exception as e:  # orbax wraps thread errors in several types; keep the cause
            self._in_flight.clear()  # the failed step's manifest will never be written
            orbax_logs.release_stranded_waits()
            cause = e
            while cause.__cause__ is not None and not isinstance(cause, OSError):
                cause = cause.__cause__
            # tensorstore's messages are long paths; lead with the OS reason when it has one
            text = str(cause)
            reason = next((os.strerror(n) for n in _WRITE_ERRNOS if os.strerror(n) in text), None)
            committed = self.latest_step()
            raise CheckpointWriteError(
                f"writing checkpoint step {self._pending} in {self.directory} failed"
                + (f": {reason}" if reason else "")
                + f" ({one_line(cause, 160)}); "
                "the newest complete checkpoint is "
                + (f"step {committed}, intact" if committed is not None else "none")
                + ": fix the cause and run the same command again to resume"
            ) from e

    def check(self) -> None:
        """Raise CheckpointWriteError if a background save has failed (cheap; call it
        every step so a full disk stops the run at the failing save, not the next one)."""
        with self._write_errors():
            self._mngr.check_for_errors()  # the checkpointer's commit thread
            if self._finalized():  # the manager's finalize thread (it runs our manifest callback)
                self._mngr.wait_until_finished()  # returns at once; raises what that thread raised

    def _finalized(self) -> bool:
        """Whether the manager's save-finalize thread has ended (so waiting costs nothing).
        Orbax keeps no public flag for it; without the attribute, say no (the error then
        shows at the next save or wait)."""
        thread = getattr(self._mngr, "_finalize_thread", None)
        try:
            return bool(thread.map(lambda t: t is not None and not t.is_alive()))
        except AttributeError:
            return False

    def _write_manifest(self) -> None:
        # Orbax calls this on the primary process once every process finished writing,
        # before it renames the tmp directory: the manifest commits with the checkpoint.
        step = self._in_flight.popleft()
        tmp = sorted(self.directory.glob(f"{step}{TMP_SUFFIX}*"))
        manifest.write_manifest(tmp[-1] if tmp else self.directory / str(step), step)

    def wait(self) -> None:
        """Block until the writes in flight are committed (raises CheckpointWriteError
        for a failed one)."""
        with self._write_errors():
            self._mngr.wait_until_finished()

    def close(self) -> None:
        """Wait for the writes in flight (raising CheckpointWriteError for a failed one)
        and release orbax's threads."""
        try:
            self.wait()
        except BaseException:
            with contextlib.suppress(Exception):  # it would raise the same failure again
                self._mngr.close()
            raise
        self._mngr.close()

    def __enter__(self) -> "Checkpointer":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- listing and checking -------------------------------------------------------------

    def steps(self) -> list[int]:
        """Committed steps, ascending (interrupted saves are not listed). Orbax lists a
        step from the moment its save starts; it is committed once its directory carries
        its final name (orbax renames the tmp directory last), so only those count."""
        return sorted(s for s in self._mngr.all_steps() if self.step_dir(s).is_dir())

    def latest_step(self) -> int | None:
        steps = self.steps()
        return steps[-1] if steps else None

    def step_dir(self, step: int) -> Path:
        return self.directory / str(step)

    def check_files(self, step: int) -> str | None:
        """Compare `step`'s files with its manifest: None when all are there with their
        sizes and CRC-32 checksums (manifests written before checksums: sizes only);
        else the problem (first missing, resized or changed file). Raises
        FileNotFoundError when the step has no manifest."""
        return manifest.check_files(self.step_dir(step))

    def saved_metadata(self, step: int) -> dict[str, Any]:
        """{path: metadata with .shape and .dtype} of the saved state (the shard index, or orbax's)."""
        if shard_files.is_shard_dir(self.step_dir(step) / "state"):
            return shard_files.metadata(self.step_dir(step) / "state")
        md = ocp.PyTreeCheckpointHandler().metadata(epath.Path(self.step_dir(step) / "state"))
        return tree_paths(md.tree)

    def check_fits(self, step: int, target, filled: tuple[str, ...] = ()) -> None:
        """CheckpointError listing the paths whose saved shapes differ from `target`'s
        (`fits.check_fits`; the paths in `filled` may be absent)."""
        fits.check_fits(self.step_dir(step), self.saved_metadata(step), target, filled)

    def usable_step(self, step: int | None = None) -> tuple[int, list[str]]:
        """(the newest step whose files match their manifest, or exactly `step`, checked
        too; the notes on damaged steps skipped): `restore`'s choice without reading the
        arrays. CheckpointError when none is usable."""
        _, s, notes = self._try_steps(step, lambda s: None)
        return s, notes

    def _try_steps(
        self, step: int | None, fn: Callable[[int], Any], crc_on_read: bool = False
    ) -> tuple[Any, int, list[str]]:
        """fn(s) for the newest usable step (or exactly `step`): damaged steps (manifest
        mismatch, read errors) are skipped and reported; CheckpointError propagates.
        `crc_on_read`: `fn` reads shard files checking their CRC-32s (`shard_files`), so the
        manifest check leaves those to it (sizes still checked) and each byte is read once."""
        steps = self.steps()
        if not steps:
            raise CheckpointError(f"{self.directory}: no complete checkpoint")
        if step is not None and step not in steps:
            raise CheckpointError(
                f"{self.directory}: no checkpoint for step {step}; steps: {', '.join(map(str, steps))}"
            )
        notes: list[str] = []
        failed: list[str] = []
        for s in [step] if step is not None else steps[::-1]:
            try:
                problem = manifest.check_files(self.step_dir(s), crc_checked_on_read=crc_on_read)
            except FileNotFoundError:
                problem = None
                notes.append(f"checkpoint step {s} has no {MANIFEST}: restoring it unverified")
            except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:  # a malformed manifest
                problem = f"unreadable {MANIFEST} ({one_line(e)})"
            if problem is None:
                try:
                    return fn(s), s, notes
                except CheckpointError:
                    raise
                except Exception as e:  # orbax / tensorstore raise many types on bad files
                    problem = one_line(e)
            failed.append(f"step {s}: {problem}")
            notes.append(
                f"checkpoint step {s} in {self.directory} is damaged ({problem}); falling back to the previous one"
            )
        raise CheckpointError(f"{self.directory}: no checkpoint restores ({'; '.join(failed)})")

    # -- restoring ------------------------------------------------------------------------

    def restore(
        self, abstract_state, step: int | None = None, *, set_aside_damaged=False, then=None, fill_missing=None
    ) -> Restored:
        """Restore the newest usable step (or `step`) laid out as `abstract_state` (a
        tree of ShapeDtypeStructs with shardings; dtypes are cast to the target's).
        `then(state, the step's state dir) -> state` finishes it (an nvme run's layer files).
        `fill_missing(path) -> bool`: target leaves it accepts may be absent from the step and
        are created as zeros (`fits`; an older checkpoint of a model that gained them), listed
        in `Restored.filled`.

        A damaged newer step (its files, or `then` raising on them) is skipped (see `Restored.warnings`); with
        `set_aside_damaged` it is moved to `<directory>.damaged/` so the run can save
        that step again. Raises CheckpointError when nothing restores or the shapes
        differ from the target."""

        def load(s):
            filled = fits.fillable(self.saved_metadata(s), abstract_state, fill_missing)
            self.check_fits(s, abstract_state, filled)
            extras = self._mngr.restore(s, args=ocp.args.Composite(extras=ocp.args.JsonRestore()))["extras"]
            state = self._read_state(s, fits.without(abstract_state, filled), partial=bool(filled))
            state = fits.with_zeros(state, abstract_state, filled)
            return (state if then is None else then(state, self.step_dir(s) / "state")), dict(extras or {}), filled

        (state, extras, filled), s, notes = self._try_steps(step, load, crc_on_read=True)
        if set_aside_damaged and not self.read_only:
            self._set_aside([d for d in self.steps() if d > s])
        return Restored(state, extras, s, notes, filled)

    def restore_params(self, abstract_params, step: int | None = None) -> tuple[Any, int, list[str]]:
        """Only the saved `params` subtree, laid out as `abstract_params` (ShapeDtypeStructs
        with shardings); the optimizer state is never read. Returns (params, step, warnings)."""

        def load(s):
            self.check_fits(s, {"params": abstract_params})
            return self._read_state(s, {"params": abstract_params}, partial=True)["params"]

        return self._try_steps(step, load, crc_on_read=True)

    def _read_state(self, step: int, target, partial: bool = False):
        """The saved state (or, `partial`, the part of it `target` names) laid out as `target`."""
        where = self.step_dir(step) / "state"
        if shard_files.is_shard_dir(where):
            return shard_files.read_tree(where, target)
        if partial:
            restore_args = ocp.checkpoint_utils.construct_restore_args(target)
            args = ocp.args.PyTreeRestore(item=target, partial_restore=True, restore_args=restore_args)
            return ocp.PyTreeCheckpointer().restore(where, args=args)
        return ocp.Checkpointer(ocp.StandardCheckpointHandler()).restore(where, args=ocp.args.StandardRestore(target))

    def read_leaf(self, step: int, path: str) -> np.ndarray:
        """One saved array (e.g. "params/blocks/attn/wq") as a host numpy array."""
        if shard_files.is_shard_dir(self.step_dir(step) / "state"):
            return shard_files.read_whole(self.step_dir(step) / "state", path)
        item: dict = {}
        node = item
        keys = path.split("/")
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = 0
        restore_args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), item)
        out = ocp.PyTreeCheckpointer().restore(
            self.step_dir(step) / "state",
            args=ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True),
        )
        for k in keys:
            out = out[k]
        return out

    def _set_aside(self, steps: list[int]) -> None:
        if not steps:  # the same list on every process
            return
        if jax.process_index() == 0:
            dest = self.directory.with_name(self.directory.name + ".damaged")
            dest.mkdir(parents=True, exist_ok=True)
            for s in steps:
                target = dest / str(s)
                if target.exists():
                    target = dest / f"{s}-{int(time.time())}"
                shutil.move(str(self.step_dir(s)), str(target))
        _sync("set_aside_damaged")
        self._mngr.reload()


def restore(directory: str | os.PathLike, abstract_state, step: int | None = None) -> tuple[Any, dict]:
    """(state, extras) of the newest usable checkpoint in `directory` (or `step`), laid out
    as `abstract_state`. Damaged steps skipped on the way are reported with warnings.warn."""

    ckpt = Checkpointer(directory, read_only=True)
    r = ckpt.restore(abstract_state, step)
    for w in r.warnings:
        warnings.warn(w, stacklevel=2)
    return r.state, r.extras


def latest_step(directory: str | os.PathLike) -> int | None:
    """The newest committed step in `directory`, or None (also when it does not exist)."""
    if not Path(directory).is_dir():
        return None
    return Checkpointer(directory, read_only=True).latest_step()
