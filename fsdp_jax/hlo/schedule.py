"""Compiled-HLO analysis: which collectives a step runs, where, and what overlaps them.

    sched = collective_schedule(compiled.as_text(), hosts=[d.process_index for d in mesh.devices.flat])
    for c in sched: print(c["op"], c["dtype"], c["bytes"], c["loop"], c["phase"], c["async"], c["overlap"])
    warns = schedule_warnings(sched, compute_dtype="bfloat16", shards_grads=True)

Works on any compiled module's text (XLA:GPU's scheduled HLO is where it matters: XLA:CPU
never emits reduce-scatter and upcasts bf16 collectives). Nothing here is model-specific.

One record per collective instruction (an async `*-start`/`*-done` pair counts once):
`op` (all-gather, reduce-scatter, all-reduce, all-to-all, collective-permute), `dtype`
(largest element's; `dtypes`: bytes per dtype; `hlo_dtypes`: results per HLO dtype), `bytes` (result bytes per device per execution: the gathered
buffer of an all-gather, the shard of a reduce-scatter; a combined collective sums its
elements), `runs` and `bytes_per_step` (times the while-loop trip counts around it),
`loop` (JAX op name of the innermost while loop around it, None outside loops),
`phase` (`forward`, `backward` = inside `transpose(jvp(...))`, or `other`: the optimizer
update, loss/norm reductions), `async` (start/done pair), `overlap` (compute
instructions the schedule puts between start and done: fusions, GEMMs, custom calls;
None when the pair straddles a loop iteration, `pipelined`), `group_size` and
`crosses_hosts` (from the replica groups and, when given, each device's host).
A TPU program for several slices sends its cross-slice collectives as Megascale host
transfers (`send` with `_xla_megascale_transfer_type`): each is recorded as that collective
(op from the transfer type, bytes of the sent buffer, `crosses_hosts` True, `group_size`
the number of slices in `hosts`).

Parts live beside it: `hlo_calls` (the call structure: computations, loops, trip counts),
`hlo_types` (result dtypes and sizes), `hlo_groups` (replica groups) and `hlo_warnings`
(`schedule_warnings`, `involuntary_rematerializations`); this module re-exports their
public names.
"""

from __future__ import annotations

import re
from collections import Counter, defaultdict
from typing import Any

from fsdp_jax.hlo.calls import OP_NAME_RE, call_graph, enclosing_loops, executions, parse_computations
from fsdp_jax.hlo.groups import replica_groups
from fsdp_jax.hlo.types import DTYPE_BYTES, DTYPE_NAMES, result_shapes, top_level, type_shapes

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_COMPUTE_OPS = ("fusion", "custom-call", "convolution", "dot")
# XLA:TPU lowers a collective across slices (over the data-center network) to a host-transfer
# `send` for the Megascale runtime: `_xla_megascale_transfer_type="ALL_REDUCE"` (or ALL_GATHER, ...)
_MEGASCALE_RE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')


# ----------------------------------------------------------------------------- the schedule


def _phase(op_name: str) -> str | None:
    if "transpose(" in op_name:
        return "backward"
    if "jvp(" in op_name:
        return "forward"
    return None


def _is_gemm(op: str, line: str) -> bool:
    return (
        (op == "custom-call" and "gemm" in line)
        or (op == "fusion" and "gemm_fusion" in line)
        or op in ("dot", "convolution")
    )


def parse_instructions(lines: list[str]) -> list[tuple[int, str, str, str, str]]:
    """(line index, name, op, result type, line) of each instruction of a computation, in
    schedule order."""
    parsed = []
    for i, line in enumerate(lines):
        m = _INSTR_RE.match(line)
        if m:
            parsed.append((i, m.group(1), m.group(3), m.group(2), line))
    return parsed


def _size_fields(shapes: list[tuple[str, int]]) -> dict[str, Any]:
    """A record's `dtype` (the largest element's), `dtypes` (bytes per dtype),
    `hlo_dtypes` (results per HLO dtype), `elements` and `bytes` from its result shapes."""
    nbytes = sum(n * DTYPE_BYTES[dt] for dt, n in shapes)
    dtypes = Counter()
    for dt, n in shapes:
        dtypes[dt] += n * DTYPE_BYTES[dt]
    dtype = max(dtypes, key=dtypes.get) if dtypes else "?"
    hlo_dtypes = Counter(dt for dt, _ in shapes)
    return {
        "dtype": DTYPE_NAMES.get(dtype, dtype),
        "dtypes": {DTYPE_NAMES.get(d, d): b for d, b in dtypes.items()},
        "hlo_dtypes": dict(hlo_dtypes),
        "elements": len(shapes),
        "bytes": nbytes,
    }


def _async_pair(parsed, k: int, name: str, done_op: str, position: dict[str, int]):
    """(overlap, pipelined, the done's line) of the async start `parsed[k]`: the compute
    instructions scheduled between it and its `done_op`; (None, True, None) when the done
    is not in this computation (a later iteration's)."""
    done = next(
        (d for d in parsed[k + 1 :] if d[2] == done_op and re.search(rf"\(%?{re.escape(name)}[),]", d[4])),
        None,
    )
    if done is None:
        return None, True, None  # done in a later iteration / another computation
    between = parsed[k + 1 : position[done[1]]]
    comp = [b for b in between if b[2] in _COMPUTE_OPS]
    overlap = {
        "ops": len(comp),
        "gemms": sum(_is_gemm(b[2], b[4]) for b in comp),
        "names": [b[1] for b in comp[:6]],
    }
    return overlap, False, done[4]


def _group_fields(line: str, megascale: bool, hosts: list[int] | None, n_dev: int | None):
    """(group_size, crosses_hosts) of a collective line, from its replica groups and each
    device's host (None where unknown)."""
    if megascale:  # one device per slice takes part (its peers in the other slices)
        return (len(set(hosts)) if hosts else None), True
    groups = replica_groups(line, n_dev)
    group_size = max((len(g) for g in groups), default=None) if groups else None
    crosses = None
    if groups and hosts:
        crosses = any(len({hosts[d] for d in g if d < len(hosts)}) > 1 for g in groups)
    return group_size, crosses


def collective_schedule(hlo: str, hosts: list[int] | None = None) -> list[dict[str, Any]]:
    """One record per collective of the compiled module (see the module docstring).
    `hosts`: the host (process index) of each device id, to tell collectives that
    cross hosts from those that stay within one."""
    comps, entry = parse_computations(hlo)
    edges, loops = call_graph(comps)
    runs = executions(comps, edges, entry)
    loop_of = enclosing_loops(comps, edges, loops)
    n_dev = len(hosts) if hosts else None
    out: list[dict[str, Any]] = []
    for cname, lines in comps.items():
        parsed = parse_instructions(lines)
        position = {name: k for k, (_, name, _, _, _) in enumerate(parsed)}
        for k, (i, name, op, type_str, line) in enumerate(parsed):
            base = op.removesuffix("-start")
            megascale = _MEGASCALE_RE.search(line) if op == "send" else None
            if megascale:  # a cross-slice collective: its buffer is the send's first operand
                base = megascale.group(1).lower().replace("_", "-")
            if base not in COLLECTIVES or op.endswith("-done"):
                continue
            is_start = op.endswith("-start") or bool(megascale)
            shapes = type_shapes(top_level(type_str)[0])[:1] if megascale else result_shapes(type_str, base, is_start)
            sizes = _size_fields(shapes)
            op_name_m = OP_NAME_RE.search(line)
            op_name = op_name_m.group(1) if op_name_m else ""
            lp = loop_of.get(cname)
            phase = _phase(op_name) or (_phase(lp["op_name"]) if lp else None) or "other"
            overlap = None
            pipelined = False
            if is_start:
                done_op = "send-done" if megascale else base + "-done"
                overlap, pipelined, done_line = _async_pair(parsed, k, name, done_op, position)
                if done_line is not None and not op_name:
                    om = OP_NAME_RE.search(done_line)
                    op_name = om.group(1) if om else ""
                    phase = _phase(op_name) or phase
            group_size, crosses = _group_fields(line, bool(megascale), hosts, n_dev)
            k_runs = runs.get(cname, 1)
            out.append(
                {
                    "op": base,
                    "name": name,
                    "computation": cname,
                    **sizes,
                    "runs": k_runs,
                    "bytes_per_step": sizes["bytes"] * k_runs,
                    "loop": lp["op_name"] or lp["body"] if lp else None,
                    "loop_trip_count": lp["trip_count"] if lp else None,
                    "phase": phase,
                    "async": is_start,
                    "pipelined": pipelined,
                    "overlap": overlap,
                    "group_size": group_size,
                    "crosses_hosts": crosses,
                    "op_name": op_name,
                    "channel_id": int(ch.group(1)) if (ch := _CHANNEL_RE.search(line)) else None,
                }
            )
    return _merge_collective_fusions(out, comps)


_CHANNEL_RE = re.compile(r"\bchannel_id=(\d+)")
_FUSION_CALL_RE = re.compile(r"\sfusion\(.*\bcalls=%?([\w.\-]+)")


def _merge_collective_fusions(records: list[dict[str, Any]], comps: dict[str, list[str]]) -> list[dict[str, Any]]:
    """XLA:TPU's async collective fusion spreads one collective over several fusions (an
    `async-collective-start`, compute fusions that carry it on, an `async-collective-done`),
    each fused computation holding a copy of the collective with the same channel_id: keep
    one record per (channel_id, computation the fusions sit in), asynchronous, overlapped by
    the carrying fusions."""
    caller = {}
    for cname, lines in comps.items():
        for line in lines:
            m = _FUSION_CALL_RE.search(line)
            if m:
                caller.setdefault(m.group(1), cname)
    groups: dict[tuple, list[dict[str, Any]]] = defaultdict(list)
    out = []
    for r in records:
        if r["channel_id"] is not None and r["computation"] in caller:
            key = (r["channel_id"], caller[r["computation"]])
            if not groups[key]:
                out.append(r)
            groups[key].append(r)
        else:
            out.append(r)
    for copies in groups.values():
        if len(copies) > 1:
            carriers = [c["computation"] for c in copies[1:]]
            copies[0].update(
                {
                    "async": True,
                    "pipelined": False,
                    "overlap": {"ops": len(carriers), "gemms": 0, "names": carriers[:6]},
                }
            )
    return out


def schedule_totals(schedule: list[dict[str, Any]]) -> dict[str, dict[str, int]]:
    """{op: {"count": runs per step, "bytes": bytes per step}} from a schedule."""
    tot: dict[str, dict[str, int]] = {}
    for c in schedule:
        t = tot.setdefault(c["op"], {"count": 0, "bytes": 0})
        t["count"] += c["runs"]
        t["bytes"] += c["bytes_per_step"]
    return tot


def wire_bytes(c: dict[str, Any]) -> int:
    """Bytes one device sends per step for collective record `c` with ring algorithms over
    its group of n: all-gather (n-1)/n of the gathered result, reduce-scatter (n-1) x
    its shard (= (n-1)/n of the full operand), all-reduce 2 (n-1)/n of the buffer,
    all-to-all (n-1)/n, collective-permute the whole buffer."""
    n = c["group_size"] or 1
    if n <= 1 and c["op"] != "collective-permute":
        return 0
    factor = {
        "all-gather": (n - 1) / n,
        "reduce-scatter": n - 1,
        "all-reduce": 2 * (n - 1) / n,
        "all-to-all": (n - 1) / n,
        "collective-permute": 1,
    }[c["op"]]
    return int(round(c["bytes_per_step"] * factor))


def communication(schedule: list[dict[str, Any]]) -> dict[str, Any]:
    """Per-step traffic per device by collective kind: {op: {"runs", "bytes" (results),
    "wire_bytes" (sent, `wire_bytes`), "cross_host_wire_bytes"}, "total_wire_bytes"}."""
    out: dict[str, Any] = {}
    for c in schedule:
        e = out.setdefault(c["op"], {"runs": 0, "bytes": 0, "wire_bytes": 0, "cross_host_wire_bytes": 0})
        w = wire_bytes(c)
        e["runs"] += c["runs"]
        e["bytes"] += c["bytes_per_step"]
        e["wire_bytes"] += w
        e["cross_host_wire_bytes"] += w if c["crosses_hosts"] else 0
    out["total_wire_bytes"] = sum(e["wire_bytes"] for e in out.values())
    return out
