"""Problems in a compiled step a user can act on, one sentence each: from a collective
schedule (`fsdp_jax.hlo.schedule.collective_schedule`: a gradient all-reduce where a
reduce-scatter was expected, float32 gathers under bf16 compute, collectives nothing
overlaps, per-layer gathers hoisted out of the layer loop) and from the SPMD
partitioner's log (involuntary full rematerializations). `fsdp_jax.hlo.schedule` re-exports them."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

from fsdp_jax.hlo.calls import OP_NAME_RE

# Both wordings XLA uses: "... was not able to go from sharding A to B without doing a full
# rematerialization of the tensor for HLO operation: %x = ..." (spmd_partitioner.cc, jax 0.10)
# and "... cannot go from sharding A to B efficiently for HLO operation %x = ... As the last
# resort, SPMD will replicate the tensor" (the same file, newer messages).
_REMAT_RE = re.compile(
    r"Involuntary full rematerialization.*?from sharding (.*?) to (.*?) (?:without doing|efficiently for)"
    r".*?HLO operation:? %?([\w.\-]+) = (\S+) ([\w\-]+)(.*?)(?:You probably|As the last resort|$)"
)


def involuntary_rematerializations(log: str) -> list[dict[str, str]]:
    """The SPMD partitioner's "Involuntary full rematerialization" messages in a
    compile's stderr: [{"tensor", "shape", "opcode", "from", "to", "op_name"}] ("op_name" is
    empty when the instruction carries no JAX source op, e.g. one the partitioner made). A
    message in neither known wording keeps its text: {"line": the message, from its start}."""
    out = []
    for line in log.splitlines():
        at = line.find("Involuntary full rematerialization")
        if at < 0:
            continue
        m = _REMAT_RE.search(line)
        if not m:
            out.append({"line": line[at:].strip()[:300]})
            continue
        op = OP_NAME_RE.search(m.group(6))
        out.append(
            {
                "tensor": m.group(3),
                "shape": m.group(4),
                "opcode": m.group(5),
                "from": m.group(1).rstrip("."),
                "to": m.group(2).rstrip("."),
                "op_name": op.group(1) if op else "",
            }
        )
    return out


def rematerialization_warning(r: dict[str, str]) -> str:
    """One sentence for an `involuntary_rematerializations` entry, naming the HLO instruction
    (and its JAX op when it has one); an unparsed message is quoted."""
    if "tensor" not in r:
        return f"the partitioner reported: {r['line']}"
    source = f", from {r['op_name']}" if r["op_name"] else ""
    return (
        f"involuntary full rematerialization of {r['tensor']} {r['shape']} ({r['opcode']}{source}): the "
        f"partitioner could not go from sharding {r['from']} to {r['to']} without materialising the whole "
        f"tensor on every device; constrain it (or its producer) to a layout that maps onto the target one"
    )


def _fmt(n: float) -> str:
    for unit, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def schedule_warnings(
    schedule: list[dict[str, Any]],
    *,
    compute_dtype: str | None = None,
    shards_grads: bool = False,
    gathers_per_layer: bool = False,
    param_bytes_threshold: int | None = None,
    layer_gather_bytes: int | None = None,
    replicated_group: int = 1,
) -> list[str]:
    """Problems in a compiled schedule a user can act on, one sentence each.

    `shards_grads`: the strategy reduce-scatters grads (ZeRO-2/3, HSDP), so a
    parameter-sized all-reduce in the backward pass that stays within a host means
    the reduce-scatter was lost, except over `replicated_group` devices (HSDP: the `data`
    axis size, over which grad shards are all-reduced by design);
    `compute_dtype`: params are gathered in this dtype, so a float32 gather under
    bfloat16 compute doubles the traffic; `param_bytes_threshold`: from how many bytes
    a collective counts as parameter-sized (default 1 MiB); `gathers_per_layer` with
    `layer_gather_bytes`: the bytes that may legitimately be gathered outside the layer
    loop (the unstacked params); more means the per-layer gathers were hoisted.
    """
    big = param_bytes_threshold if param_bytes_threshold is not None else 1 << 20
    has_loops = any(c["loop"] for c in schedule)
    found = _findings(schedule, big, compute_dtype, shards_grads, replicated_group)
    out = [_finding_message(kind, op, loop, phase, cs, compute_dtype) for (kind, op, loop, phase), cs in found.items()]
    if gathers_per_layer and layer_gather_bytes is not None and has_loops:
        outside = sum(c["bytes"] for c in schedule if c["op"] == "all-gather" and not c["loop"])
        if outside > 1.5 * layer_gather_bytes + (1 << 20):
            out.append(
                f"whole-model gather hoisted out of the layer loop: {_fmt(outside)} all-gathered "
                f"outside any loop (expected <= {_fmt(layer_gather_bytes)}, the unstacked params), "
                f"so every layer's params are resident at once; keep the layer params inside the "
                f"scanned body and do not constrain them to a replicated layout"
            )
    return out


def _findings(
    schedule: list[dict[str, Any]], big: int, compute_dtype: str | None, shards_grads: bool, replicated_group: int
) -> dict[tuple[str, str, str | None, str], list[dict[str, Any]]]:
    """The parameter-sized (>= `big` bytes) collectives of `schedule` that show a problem,
    grouped by (kind, op, loop, phase); kinds: `grad-all-reduce`, `f32-gather`,
    `no-overlap` (see `schedule_warnings`)."""
    found: dict[tuple[str, str, str | None, str], list[dict[str, Any]]] = defaultdict(list)
    for c in schedule:
        if c["bytes"] < big:
            continue
        if (
            shards_grads
            and c["op"] == "all-reduce"
            and c["phase"] == "backward"
            and not (replicated_group > 1 and c["group_size"] == replicated_group)
        ):
            found[("grad-all-reduce", c["op"], c["loop"], c["phase"])].append(c)
        if (
            compute_dtype in ("bfloat16", "float16")
            and c["op"] == "all-gather"
            and c["dtype"] == "float32"
            and c["phase"] in ("forward", "backward")
        ):
            found[("f32-gather", c["op"], c["loop"], c["phase"])].append(c)
        if not c["async"] or (c["overlap"] is not None and c["overlap"]["ops"] == 0):
            found[("no-overlap", c["op"], c["loop"], c["phase"])].append(c)
    return found


def _finding_message(
    kind: str, op: str, loop: str | None, phase: str, cs: list[dict[str, Any]], compute_dtype: str | None
) -> str:
    """One sentence for the collectives `cs` of one finding: what, where and the fix."""
    where = f"{phase} pass, " + (f"inside loop {loop}" if loop else "outside any loop")
    sizes = sorted({c["bytes"] for c in cs})
    size = _fmt(sizes[0]) if len(sizes) == 1 else f"{_fmt(sizes[0])}-{_fmt(sizes[-1])}"
    what = (
        f"{len(cs)} {op}{'s' if len(cs) > 1 else ''} ({', '.join(c['name'] for c in cs[:4])}"
        f"{', ...' if len(cs) > 4 else ''}; {cs[0]['dtype']}, {size} each, "
        f"{_fmt(sum(c['bytes_per_step'] for c in cs))} per step; {where})"
    )
    if kind == "grad-all-reduce":
        return (
            f"gradient all-reduce where a reduce-scatter was expected: {what}; every device "
            f"then sums full-size grads and keeps a slice: check that the grads are "
            f"constrained to the sharded layout where they are produced"
        )
    if kind == "f32-gather":
        return (
            f"float32 all-gather under {compute_dtype} compute: {what}; it moves twice the "
            f"bytes: cast params to the compute dtype in their sharded layout before the gather"
        )
    sync = [c for c in cs if not c["async"]]
    why = "synchronous" if sync else "async, but nothing is scheduled between start and done"
    return (
        f"{op} with no compute overlapping it: {what}; {why}, so the step waits "
        f"for it: see fsdp_jax.targets.xla_flags for the scheduler flags"
    )
