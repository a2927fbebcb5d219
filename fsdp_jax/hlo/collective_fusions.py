"""XLA:TPU's async collective fusions, as the op walk (`fsdp_jax.hlo.costs`) sees them.

    roles = fusion_roles(parsed_rows_of_one_computation, fused_collectives(parsed))
    roles[k]   # ("start", done_pos, fused comps) | ("carrier", in-flight bytes) | ("done",)

With libtpu's continuation-fusion flags (MaxText's `CF_FOR_ALL_GATHER`:
`--xla_tpu_enable_async_collective_fusion...`, `fsdp_jax/targets/tpu_flags.json`) XLA:TPU
writes one collective as several fusions in a sequential computation: an
`async-collective-start` fusion, compute fusions that carry it on (each takes the collective's
in-flight buffers and hands them on, beside its own work) and an `async-collective-done`
fusion. Each of their fused computations holds a copy of the collective with the same
`channel_id`. The collective runs from the first of them to the last, hidden by whatever
compute is scheduled between (`fsdp_jax.app.planner.op_costs`); the start and done are the
collective, not compute of their own; a carrier's own cost leaves out the in-flight buffers it
passes through (the collective's shard and result, each read and written once: aliased, not
touched by its compute). A channel met only once in a computation is a collective fused
alone: synchronous.
"""

from __future__ import annotations

import re
from typing import Any

from fsdp_jax.hlo.schedule import COLLECTIVES
from fsdp_jax.hlo.types import DTYPE_BYTES, type_shapes

_CHANNEL_RE = re.compile(r"\bchannel_id=(\d+)")
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_OPERAND_RE = re.compile(r"\(%?([\w.\-]+)[,)]")


def _nbytes(type_str: str) -> int:
    return sum(n * DTYPE_BYTES[dt] for dt, n in type_shapes(type_str))


def fused_collectives(parsed: dict[str, list[tuple]]) -> dict[str, tuple[int, int]]:
    """{fused computation: (channel_id, in-flight bytes)} for every computation that holds a
    collective with a channel_id; in-flight bytes = the collective's operand + result bytes.
    `parsed`: computation -> `fsdp_jax.hlo.schedule.parse_instructions` rows."""
    out = {}
    for comp, rows in parsed.items():
        types = {name: t for _, name, _, t, _ in rows}
        for _, _, op, type_str, line in rows:
            ch = _CHANNEL_RE.search(line)
            if op in COLLECTIVES and ch:
                operand = _OPERAND_RE.search(line[line.find(f" {op}(") + len(op) + 1 :])
                shard = _nbytes(types.get(operand.group(1), "")) if operand else 0
                out[comp] = (int(ch.group(1)), shard + _nbytes(type_str))
                break
    return out


def fusion_roles(rows: list[tuple], fused: dict[str, tuple[int, int]]) -> dict[int, tuple[Any, ...]]:
    """{position: role} of the fusions of one sequential computation (`rows`, in schedule
    order) that call a computation of `fused`: ("start", done position or None, the fused
    computations of its channel here), ("carrier", in-flight bytes) or ("done",). One fusion
    alone for its channel: ("start", None, ...) with no done (synchronous)."""
    by_channel: dict[int, list[tuple[int, int, str]]] = {}
    for k, (_, _, op, _, line) in enumerate(rows):
        called = _CALLS_RE.search(line) if op == "fusion" else None
        if called and called.group(1) in fused:
            channel, inflight = fused[called.group(1)]
            by_channel.setdefault(channel, []).append((k, inflight, called.group(1)))
    roles: dict[int, tuple[Any, ...]] = {}
    for at in by_channel.values():
        first, last = at[0][0], at[-1][0]
        roles[first] = ("start", last if len(at) > 1 else None, frozenset(c for _, _, c in at))
        for k, inflight, _ in at[1:-1]:
            roles[k] = ("carrier", inflight)
        if len(at) > 1:
            roles[last] = ("done",)
    return roles
