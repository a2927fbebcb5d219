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
"""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from typing import Any

import numpy as np

from fsdp_jax.hlo_calls import _OP_NAME_RE, _reach, call_graph, enclosing_loops, executions, parse_computations  # noqa: F401

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")
_DTYPE_BYTES = {
    "f32": 4,
    "bf16": 2,
    "f16": 2,
    "f64": 8,
    "s32": 4,
    "u32": 4,
    "s8": 1,
    "u8": 1,
    "pred": 1,
    "s64": 8,
    "u64": 8,
    "s16": 2,
    "u16": 2,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
}
_DTYPE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}
_SHAPE_RE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_INSTR_RE = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s([a-z][\w\-]*)\((.*)$")
_COLLECTIVE_RE = {op: re.compile(rf"\s{op}(-start)?\(") for op in COLLECTIVES}
_COMPUTE_OPS = ("fusion", "custom-call", "convolution", "dot")
# XLA:TPU lowers a collective across slices (over the data-center network) to a host-transfer
# `send` for the Megascale runtime: `_xla_megascale_transfer_type="ALL_REDUCE"` (or ALL_GATHER, ...)
_MEGASCALE_RE = re.compile(r'_xla_megascale_transfer_type="(\w+)"')
_REMAT_RE = re.compile(
    r"Involuntary full rematerialization.*?from sharding (.*?) to (.*?) without doing"
    r".*?HLO operation: %?([\w.\-]+) = (\S+)(.*?)(?:You probably|$)"
)


# ----------------------------------------------------------------------------- types, groups


def _top_level(s: str) -> list[str]:
    """Top-level comma-separated parts of a tuple type '(a, (b, c), d)'."""
    s = s.strip()
    if not s.startswith("("):
        return [s]
    parts, depth, cur = [], 0, ""
    for ch in s[1:-1]:
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def _shapes(type_str: str) -> list[tuple[str, int]]:
    return [(dt, math.prod(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE_RE.findall(type_str)]


def result_shapes(type_str: str, op: str, is_start: bool) -> list[tuple[str, int]]:
    """(dtype, elements) of what a collective produces. An async `-start` that returns
    ((operands), results) keeps the results: all-gather, reduce-scatter and all-to-all on
    every XLA (with one operand the start returns (operand, result)), and all-reduce from XLA 0.12 on (before, its start returned the result alone)."""
    if is_start and type_str.startswith("(("):
        parts = _top_level(type_str)
        if len(parts) >= 2:
            return _shapes(parts[1])
    if is_start and op in ("all-gather", "reduce-scatter", "all-to-all") and type_str.startswith("("):
        parts = _top_level(type_str)  # one operand: (operand, result)
        if len(parts) == 2:
            return _shapes(parts[1])
    if is_start and op == "collective-permute":
        parts = _top_level(type_str)
        return _shapes(parts[1] if len(parts) >= 2 else type_str)
    return _shapes(type_str)


def replica_groups(line: str, n_devices: int | None = None) -> list[list[int]] | None:
    """The replica groups of a collective line as lists of device ids, from any of
    XLA's spellings: {{0,1},{2,3}}; [2,4]<=[8]; [4,2]<=[2,4]T(1,0); mesh['a'=4,'b'=2]
    (optionally device_ids=([2,4]T(1,0))) {'b'}; {} (all devices). None if unknown."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(s) for _, s in axes]
        ids = np.arange(math.prod(sizes))
        if m.group(2):
            ids = _iota(m.group(2), math.prod(sizes))
        ids = ids.reshape(sizes)
        keep = [a.strip().strip("'") for a in m.group(3).split(",") if a.strip()]
        idx = [i for i, (a, _) in enumerate(axes) if a in keep]
        rest = [i for i in range(len(axes)) if i not in idx]
        grid = ids.transpose(rest + idx).reshape(-1, math.prod(sizes[i] for i in idx) if idx else 1)
        return grid.tolist()
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
    if m:
        dims = [int(x) for x in re.match(r"\[([\d,]+)\]", m.group(1)).group(1).split(",")]
        ids = _iota(m.group(1).split("<=", 1)[1], math.prod(dims))
        return ids.reshape(dims[0], -1).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", line)
    if m is not None:
        groups = re.findall(r"\{([\d,\s]*)\}", m.group(1))
        if groups:
            return [[int(x) for x in g.split(",") if x.strip()] for g in groups]
        return [list(range(n_devices))] if n_devices else None
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", m.group(0))]
    return None


def _iota(spec: str, n: int) -> np.ndarray:
    """Device ids of an iota spec '[2,4]T(1,0)' or '[8]' (flattened)."""
    m = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec.strip())
    if not m:
        return np.arange(n)
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)


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
        parsed = []
        for i, line in enumerate(lines):
            m = _INSTR_RE.match(line)
            if m:
                parsed.append((i, m.group(1), m.group(3), m.group(2), line))
        position = {name: k for k, (_, name, _, _, _) in enumerate(parsed)}
        for k, (i, name, op, type_str, line) in enumerate(parsed):
            base = op.removesuffix("-start")
            megascale = _MEGASCALE_RE.search(line) if op == "send" else None
            if megascale:  # a cross-slice collective: its buffer is the send's first operand
                base = megascale.group(1).lower().replace("_", "-")
            if base not in COLLECTIVES or op.endswith("-done"):
                continue
            is_start = op.endswith("-start") or bool(megascale)
            shapes = _shapes(_top_level(type_str)[0])[:1] if megascale else result_shapes(type_str, base, is_start)
            nbytes = sum(n * _DTYPE_BYTES[dt] for dt, n in shapes)
            dtypes = Counter()
            for dt, n in shapes:
                dtypes[dt] += n * _DTYPE_BYTES[dt]
            dtype = max(dtypes, key=dtypes.get) if dtypes else "?"
            hlo_dtypes = Counter(dt for dt, _ in shapes)
            op_name_m = _OP_NAME_RE.search(line)
            op_name = op_name_m.group(1) if op_name_m else ""
            lp = loop_of.get(cname)
            phase = _phase(op_name) or (_phase(lp["op_name"]) if lp else None) or "other"
            overlap = None
            pipelined = False
            if is_start:
                done = next(
                    (
                        d
                        for d in parsed[k + 1 :]
                        if d[2] == ("send-done" if megascale else base + "-done")
                        and re.search(rf"\(%?{re.escape(name)}[),]", d[4])
                    ),
                    None,
                )
                if done is None:
                    pipelined = True  # done in a later iteration / another computation
                else:
                    between = parsed[k + 1 : position[done[1]]]
                    comp = [b for b in between if b[2] in _COMPUTE_OPS]
                    overlap = {
                        "ops": len(comp),
                        "gemms": sum(_is_gemm(b[2], b[4]) for b in comp),
                        "names": [b[1] for b in comp[:6]],
                    }
                    if not op_name:
                        om = _OP_NAME_RE.search(done[4])
                        op_name = om.group(1) if om else ""
                        phase = _phase(op_name) or phase
            groups = None if megascale else replica_groups(line, n_dev)
            group_size = max((len(g) for g in groups), default=None) if groups else None
            crosses = None
            if groups and hosts:
                crosses = any(len({hosts[d] for d in g if d < len(hosts)}) > 1 for g in groups)
            if megascale:  # one device per slice takes part (its peers in the other slices)
                group_size, crosses = (len(set(hosts)) if hosts else None), True
            k_runs = runs.get(cname, 1)
            out.append(
                {
                    "op": base,
                    "name": name,
                    "computation": cname,
                    "dtype": _DTYPE_NAMES.get(dtype, dtype),
                    "dtypes": {_DTYPE_NAMES.get(d, d): b for d, b in dtypes.items()},
                    "hlo_dtypes": dict(hlo_dtypes),
                    "elements": len(shapes),
                    "bytes": nbytes,
                    "runs": k_runs,
                    "bytes_per_step": nbytes * k_runs,
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


# ----------------------------------------------------------------------------- warnings


def involuntary_rematerializations(log: str) -> list[dict[str, str]]:
    """The SPMD partitioner's "Involuntary full rematerialization" messages in a
    compile's stderr: [{"tensor", "shape", "from", "to", "op_name"}]."""
    out = []
    for line in log.splitlines():
        if "Involuntary full rematerialization" not in line:
            continue
        m = _REMAT_RE.search(line)
        if not m:
            out.append({"tensor": "?", "shape": "?", "from": "?", "to": "?", "op_name": "", "line": line.strip()[:300]})
            continue
        op = _OP_NAME_RE.search(m.group(5))
        out.append(
            {
                "tensor": m.group(3),
                "shape": m.group(4),
                "from": m.group(1).rstrip("."),
                "to": m.group(2).rstrip("."),
                "op_name": op.group(1) if op else "",
            }
        )
    return out


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
    out: list[str] = []
    big = param_bytes_threshold if param_bytes_threshold is not None else 1 << 20
    has_loops = any(c["loop"] for c in schedule)
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
    for (kind, op, loop, phase), cs in found.items():
        where = f"{phase} pass, " + (f"inside loop {loop}" if loop else "outside any loop")
        sizes = sorted({c["bytes"] for c in cs})
        size = _fmt(sizes[0]) if len(sizes) == 1 else f"{_fmt(sizes[0])}-{_fmt(sizes[-1])}"
        what = (
            f"{len(cs)} {op}{'s' if len(cs) > 1 else ''} ({', '.join(c['name'] for c in cs[:4])}"
            f"{', ...' if len(cs) > 4 else ''}; {cs[0]['dtype']}, {size} each, "
            f"{_fmt(sum(c['bytes_per_step'] for c in cs))} per step; {where})"
        )
        if kind == "grad-all-reduce":
            out.append(
                f"gradient all-reduce where a reduce-scatter was expected: {what}; every device "
                f"then sums full-size grads and keeps a slice: check that the grads are "
                f"constrained to the sharded layout where they are produced"
            )
        elif kind == "f32-gather":
            out.append(
                f"float32 all-gather under {compute_dtype} compute: {what}; it moves twice the "
                f"bytes: cast params to the compute dtype in their sharded layout before the gather"
            )
        else:
            sync = [c for c in cs if not c["async"]]
            why = "synchronous" if sync else "async, but nothing is scheduled between start and done"
            out.append(
                f"{op} with no compute overlapping it: {what}; {why}, so the step waits "
                f"for it: see fsdp_jax.xla_flags for the scheduler flags"
            )
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
