"""Host offload: optimizer state (and master weights) at rest in host memory.

    built = build(model, optimizer, mesh, "full_shard", loss_fn=loss_fn, offload="optimizer")

| offload            | params at rest | optimizer state at rest | device holds between steps |
|--------------------|----------------|-------------------------|----------------------------|
| none               | device         | device                  | params + optimizer state   |
| optimizer          | device         | pinned_host             | params                     |
| optimizer+params   | pinned_host    | pinned_host             | nothing of the state       |

`optimizer:streamed` and `optimizer+params:streamed` rest the same state in the same place;
their update brings the leaves stacked over scanned layers to the device one layer at a time
(`fsdp_jax.train.stream_update`) instead of whole, and with `optimizer+params:streamed` the
model's layer loop fetches the stacked params one layer at a time too (forward, and the
backward's recompute; `fsdp_jax.train.layer_gather`): no whole-model compute copy, at the
price of their grads' round trip through host memory. `optimizer+params:streamed-update`
streams the update only and fetches the params whole for the forward pass (fewer bytes
moved, more device memory).

The at-rest shardings of the chosen state carry memory kind `pinned_host` (same mesh,
same `PartitionSpec`: each device's shard sits in its host's memory). The jitted step
takes and returns the state there and moves shards itself, inside the same program:
params come to the device at the start (and are cast to the compute dtype there), the
optimizer state (and the f32 params) come to the device only once the gradients exist
(an optimization barrier orders the transfer after the backward pass), the update runs
on the device, and the new state goes back to host memory. Running the update on the
host (`compute_on("device_host")`) was the alternative; it needs a host compute
backend per platform and moves the same bytes, so the device update was chosen.

On CPU the three memory kinds exist (`device`, `pinned_host`, `unpinned_host`) but share
one RAM: the code paths run and the compiled program's parameter layouts show which
arguments are host-resident (`S(5)`), while `memory_analysis()` reports no host bytes
(its host fields are 0 there). This module takes plain shardings and pytrees.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import NamedSharding

from fsdp_jax.errors import OffloadError
from fsdp_jax.sharding.offload_settings import OFFLOADS, Offload  # the table, data without JAX

HOST = "pinned_host"
DEVICE = "device"


def get_offload(name: "str | Offload | None") -> Offload:
    """Look up an offload setting by name; unknown names raise OffloadError listing the choices."""
    if isinstance(name, Offload):
        return name
    key = "none" if name is None else str(name).lower()
    if key not in OFFLOADS:
        raise OffloadError(f"offload: unknown setting {name!r}; choose one of {', '.join(OFFLOADS)}")
    return OFFLOADS[key]


def host_memory_available(devices: Sequence[Any]) -> bool:
    """Capability probe: jax has memory kinds on shardings and every device in
    `devices` can address a `pinned_host` memory."""
    if not hasattr(NamedSharding, "with_memory_kind"):
        return False
    for d in devices:
        try:
            kinds = {m.kind for m in d.addressable_memories()}
        except (AttributeError, NotImplementedError, RuntimeError, jax.errors.JaxRuntimeError):
            return False
        if HOST not in kinds:
            return False
    return True


def check_supported(offload: "str | Offload", devices: Sequence[Any]) -> Offload:
    """The Offload for `offload`; raises OffloadError (one line) when it moves state to
    the host but the backend or jax has no `pinned_host` memory."""
    o = get_offload(offload)
    if o.any and not host_memory_available(devices):
        platform = getattr(devices[0], "platform", "?") if len(devices) else "?"
        raise OffloadError(
            f"offload: {o.name!r} needs host memory kinds ({HOST}), which this backend "
            f"({platform}, jax {jax.__version__}) does not offer; use offload: none"
        )
    return o


def is_host(sharding: Any) -> bool:
    return getattr(sharding, "memory_kind", None) == HOST


def _is_sharding(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)


def with_kind(shardings, kind: str):
    """`shardings` (a tree of NamedShardings) with every sharding moved to memory `kind`."""
    return jax.tree.map(lambda s: s.with_memory_kind(kind), shardings, is_leaf=_is_sharding)


def on_device(shardings):
    """The device-memory twin of `shardings` (host-kind leaves become `device`; others unchanged)."""
    return jax.tree.map(lambda s: s.with_memory_kind(DEVICE) if is_host(s) else s, shardings, is_leaf=_is_sharding)


def at_rest(params, opt_state, offload: "str | Offload"):
    """(params, opt_state) shardings with the offloaded ones in `pinned_host` memory."""
    o = get_offload(offload)
    return (with_kind(params, HOST) if o.params else params, with_kind(opt_state, HOST) if o.opt_state else opt_state)


def fetch(tree, shardings, after: Any = None):
    """Inside jit: the leaves of `tree` whose at-rest sharding is host-kind, moved to the
    device (same spec); other leaves as they are. With `after`, the transfer is ordered
    after `after` is computed (an optimization barrier), so the fetched copy is not
    live on the device before it is needed."""
    if not any(is_host(s) for s in jax.tree.leaves(shardings, is_leaf=_is_sharding)):
        return tree
    if after is not None:
        tree, _ = jax.lax.optimization_barrier((tree, after))
    return jax.tree.map(
        lambda x, s: jax.device_put(x, s.with_memory_kind(DEVICE)) if is_host(s) else x,
        tree,
        shardings,
        is_leaf=_is_sharding,
    )


def store(tree, shardings):
    """Inside jit: the leaves whose at-rest sharding is host-kind, written back to host memory."""
    if not any(is_host(s) for s in jax.tree.leaves(shardings, is_leaf=_is_sharding)):
        return tree
    return jax.tree.map(lambda x, s: jax.device_put(x, s) if is_host(s) else x, tree, shardings, is_leaf=_is_sharding)


def offloaded_bytes(abstract_tree) -> dict[str, int]:
    """Per-device bytes of a tree of sharded ShapeDtypeStructs/arrays, split by memory:
    {"device": ..., "host": ...} (host = `pinned_host` / `unpinned_host` kinds)."""
    out = {"device": 0, "host": 0}
    for x in jax.tree.leaves(abstract_tree):
        s = getattr(x, "sharding", None)
        if s is None:
            continue
        shape = s.shard_shape(x.shape)
        n = int(np.prod(shape, dtype=np.int64)) * np.dtype(x.dtype).itemsize
        kind = getattr(s, "memory_kind", None) or DEVICE
        out["host" if "host" in kind else "device"] += n
    return out


def host_bytes_per_process(abstract_tree) -> int:
    """Bytes of a tree of sharded ShapeDtypeStructs/arrays resting in this process's host
    memory: every host-kind (`pinned_host` / `unpinned_host`) leaf's shard once for each
    of this process's devices that holds one (a replicated leaf once per device: each
    device's copy sits in its host's memory)."""
    total = 0
    for x in jax.tree.leaves(abstract_tree):
        s = getattr(x, "sharding", None)
        if s is None or "host" not in (getattr(s, "memory_kind", None) or DEVICE):
            continue
        shard = int(np.prod(s.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
        total += shard * len(s.addressable_devices)
    return total


# f32[8,16]{1,0:S(5)}: XLA's layout of an entry parameter; S(5) is the host memory space.
_ENTRY = re.compile(r"entry_computation_layout=\{\((.*?)\)->")
_SHAPE = re.compile(r"\b(pred|[a-z]+\d+)\[([\d,]*)\](\{[^}]*\})?")
DTYPE_BYTES = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}
HOST_MEMORY_SPACE = "S(5)"


def entry_argument_bytes(compiled_text: str) -> dict[str, int]:
    """Per-device argument bytes of a compiled program, split by memory space, read from
    the entry computation layout of `compiled.as_text()`: {"device": ..., "host": ...}.

    Backends whose `memory_analysis()` does not report host bytes (CPU) still lay out
    host-resident parameters in memory space S(5); this counts them from there."""
    m = _ENTRY.search(compiled_text)
    if m is None:
        raise ValueError("no entry_computation_layout in the compiled program text")
    out = {"device": 0, "host": 0}
    for dt, dims, layout in _SHAPE.findall(m.group(1)):
        if dt not in DTYPE_BYTES:
            continue
        n = int(np.prod([int(d) for d in dims.split(",") if d], dtype=np.int64)) * DTYPE_BYTES[dt]
        out["host" if layout and HOST_MEMORY_SPACE in layout else "device"] += n
    return out


def fetch_state(state, plan, after: Any = None):
    """Inside jit: a TrainState-like `state` (with `.replace`) whose offloaded params and
    optimizer state are moved to the device, ordered after `after` when given."""
    return state.replace(
        params=fetch(state.params, plan.params, after), opt_state=fetch(state.opt_state, plan.opt_state, after)
    )


def store_state(state, plan):
    """Inside jit: `state` with its offloaded parts written back to host memory."""
    return state.replace(params=store(state.params, plan.params), opt_state=store(state.opt_state, plan.opt_state))


def transfer_bytes(abstract_state, offload: "str | Offload", layered: Any = None) -> dict[str, int]:
    """Host<->device bytes per device per train step under `offload`, from the state's
    sharded shapes: `to_device` (offloaded params twice, for the forward pass and again
    for the update, plus the optimizer state) and `to_host` (what is written back).

    With `layered` (the plan's tree of stacked-leaf flags) and an offload that fetches
    params per layer (`Offload.layers`), the stacked params come per layer (`fsdp_jax.train.layer_gather`): once in
    the forward pass and again where the backward recomputes a layer (counted: the remat
    policies the planner ranks recompute), and their grads go to host memory in the
    backward loop and come back once after it, both in the params' dtype."""
    o = get_offload(offload)

    def nbytes(tree):
        return sum(
            int(np.prod(x.sharding.shard_shape(x.shape), dtype=np.int64)) * np.dtype(x.dtype).itemsize
            for x in jax.tree.leaves(tree)
        )

    p = nbytes(abstract_state.params) if o.params else 0
    s = nbytes(abstract_state.opt_state) if o.opt_state else 0
    stacked = 0
    if o.params and o.layers and layered is not None:
        flags = jax.tree.leaves(layered)
        stacked = nbytes([x for x, f in zip(jax.tree.leaves(abstract_state.params), flags) if f])
    return {"to_device": 2 * p + s + 2 * stacked, "to_host": p + s + stacked}
