"""Bytes per device: analytic (from shardings) and compiled (memory_analysis), and
which collectives the compiled program runs, inside or outside the layer loop."""

from __future__ import annotations

import math
import re
from collections import Counter, defaultdict
from typing import Any

import jax
import numpy as np

COLLECTIVES = ("all-gather", "reduce-scatter", "all-reduce", "all-to-all", "collective-permute")


def shard_bytes(x) -> int:
    """Bytes one device holds of `x` (array or ShapeDtypeStruct with a sharding);
    the largest shard when the split is uneven."""
    shape = tuple(x.shape)
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * np.dtype(x.dtype).itemsize


def tree_bytes_per_device(tree) -> int:
    return sum(shard_bytes(x) for x in jax.tree.leaves(tree))


def tree_bytes(tree) -> int:
    """Total (unsharded) bytes of a tree."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def state_bytes_per_device(abstract_state) -> dict[str, int]:
    """Per-device bytes of a TrainState of sharded ShapeDtypeStructs (or arrays):
    `params`, `opt_state`, `step` and `total`."""
    out = {"params": tree_bytes_per_device(abstract_state.params),
           "opt_state": tree_bytes_per_device(abstract_state.opt_state),
           "step": tree_bytes_per_device(abstract_state.step)}
    out["total"] = sum(out.values())
    return out


def compiled_memory(compiled) -> dict[str, int]:
    """`memory_analysis()` of a compiled step, per device: argument, output, alias,
    temp, generated code, and the peak.

    `peak` is argument + output - alias + temp, or XLA's own `peak_memory_in_bytes`
    when that is larger; `xla_peak` is XLA's figure as reported (XLA:CPU reports
    roughly the argument bytes there, leaving out temp, so it is not used alone).
    """
    ma = compiled.memory_analysis()
    out = {"argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
           "alias": int(ma.alias_size_in_bytes), "temp": int(ma.temp_size_in_bytes),
           "code": int(getattr(ma, "generated_code_size_in_bytes", 0))}
    out["xla_peak"] = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    out["peak"] = max(out["xla_peak"], out["argument"] + out["output"] - out["alias"] + out["temp"])
    return out


# ----------------------------------------------------------------------------- HLO

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\)|\(.*\))\s*->.*\{\s*$")
_CALLS_RE = re.compile(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)"
                       r"|\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
                "pred": 1, "s64": 8, "u64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE_RE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")
_COLLECTIVE_RE = {op: re.compile(rf"\s{op}(-start)?\(") for op in COLLECTIVES}


def _parse_computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """({computation name: its instruction lines}, the ENTRY computation's name)."""
    comps: dict[str, list[str]] = {}
    current, entry = None, None
    for line in hlo.splitlines():
        m = _COMP_RE.match(line.strip()) if line and not line.startswith(" ") else None
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    return comps, entry


def _result_types(line: str) -> list[tuple[str, int]]:
    """(dtype, elements) of an instruction's result (each element of a tuple result)."""
    rhs = line.split("=", 1)[1].strip() if "=" in line else line.strip()
    head = rhs.split(")", 1)[0] if rhs.startswith("(") else rhs.split(" ", 1)[0]
    return [(dt, math.prod(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE_RE.findall(head)]


def _collective_bytes(line: str, is_start: bool) -> tuple[int, list[str]]:
    """Result bytes per device of one collective, and its dtypes. An async `-start`
    returns a tuple that also holds its operand: count only its largest element."""
    parts = [(dt, n * _DTYPE_BYTES[dt]) for dt, n in _result_types(line)]
    if is_start and len(parts) > 1:
        parts = [max(parts, key=lambda p: p[1])]
    return sum(b for _, b in parts), [dt for dt, _ in parts]


def _call_graph(comps: dict[str, list[str]]):
    """Edges caller -> [(callee, runs per caller run)], plus the while loops found:
    a while body runs its known trip count per run of its caller (1 if unknown)."""
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    loops: list[dict[str, Any]] = []
    for name, lines in comps.items():
        for line in lines:
            is_while = " while(" in line
            trip = None
            if is_while:
                m = _TRIP_RE.search(line)
                trip = int(m.group(1)) if m else None
            for m in _CALLS_RE.finditer(line):
                names = [m.group(2)] if m.group(2) else [n.strip().lstrip("%") for n in m.group(3).split(",")]
                for callee in names:
                    if is_while and m.group(1) == "body":
                        edges[name].append((callee, trip or 1))
                        op = re.search(r'op_name="([^"]*)"', line)
                        loops.append({"body": callee, "parent": name, "trip_count": trip,
                                      "op_name": op.group(1) if op else ""})
                    elif is_while and m.group(1) == "condition":
                        edges[name].append((callee, (trip or 1) + 1))
                    else:
                        edges[name].append((callee, 1))
    return edges, loops


def _executions(comps, edges, entry: str | None) -> dict[str, int]:
    """How many times each computation runs per call of the entry computation."""
    roots = [entry] if entry in comps else [c for c in comps if not any(
        c == callee for es in edges.values() for callee, _ in es)]
    order: list[str] = []
    seen: set[str] = set()

    def visit(c):  # post-order DFS; HLO call graphs are acyclic
        stack = [(c, iter(edges.get(c, ())))]
        seen.add(c)
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                order.append(node)
                stack.pop()
            elif nxt[0] not in seen:
                seen.add(nxt[0])
                stack.append((nxt[0], iter(edges.get(nxt[0], ()))))

    for r in roots:
        if r not in seen:
            visit(r)
    runs: dict[str, int] = defaultdict(int)
    for r in roots:
        runs[r] = 1
    for c in reversed(order):  # callers before callees
        for callee, k in edges.get(c, ()):
            runs[callee] += runs[c] * k
    return dict(runs)


def collective_report(hlo: str) -> dict[str, Any]:
    """Count collectives in compiled HLO text, split into those inside a while loop
    (the scanned layer loop, or the microbatch loop) and outside.

    Returns {"inside_loop": {op: entry}, "outside_loop": {op: entry}, "per_step":
    {op: {"count", "bytes"}}, "loops": [{"body", "parent", "trip_count", "op_name"}]}.
    Each entry: `count` and `bytes` (per device, result sizes; an async `-start`
    counts its result once) as the instructions appear in the program, `runs` and
    `bytes_per_step`: the same multiplied by how many times their computation runs
    per step (a while body runs `known_trip_count` times, from the while op's
    backend_config; nested loops multiply), `dtypes`, and `op_names`: the JAX source
    ops (`transpose(jvp(...))` marks the backward pass).
    For all-gather the result is the gathered buffer; for reduce-scatter it is the
    shard (the operand is group-size times larger).
    """
    comps, entry = _parse_computations(hlo)
    edges, loops = _call_graph(comps)
    in_loop: set[str] = set()
    stack = [lp["body"] for lp in loops]
    stack += [callee for c in comps for line in comps[c] if " while(" in line
              for m in _CALLS_RE.finditer(line) if m.group(1) == "condition" for callee in [m.group(2)]]
    while stack:
        c = stack.pop()
        if c in in_loop:
            continue
        in_loop.add(c)
        stack.extend(callee for callee, _ in edges.get(c, ()))
    runs = _executions(comps, edges, entry)
    report: dict[str, Any] = {"inside_loop": {}, "outside_loop": {}}
    per_step: dict[str, dict[str, int]] = {}
    for name, lines in comps.items():
        where = "inside_loop" if name in in_loop else "outside_loop"
        k = runs.get(name, 1)
        for line in lines:
            for op, rx in _COLLECTIVE_RE.items():
                hit = rx.search(line)
                if not hit:
                    continue
                nbytes, dtypes = _collective_bytes(line, bool(hit.group(1)))
                entry_ = report[where].setdefault(
                    op, {"count": 0, "bytes": 0, "runs": 0, "bytes_per_step": 0,
                         "dtypes": Counter(), "op_names": []})
                entry_["count"] += 1
                entry_["bytes"] += nbytes
                entry_["runs"] += k
                entry_["bytes_per_step"] += k * nbytes
                entry_["dtypes"].update(dtypes)
                m = re.search(r'op_name="([^"]*)"', line)
                entry_["op_names"].append(m.group(1) if m else "")
                tot = per_step.setdefault(op, {"count": 0, "bytes": 0})
                tot["count"] += k
                tot["bytes"] += k * nbytes
    for where in ("inside_loop", "outside_loop"):
        for entry_ in report[where].values():
            entry_["dtypes"] = dict(entry_["dtypes"])
    report["per_step"] = per_step
    report["loops"] = loops
    return report


def collective_ops(hlo: str) -> list[tuple[str, str]]:
    """(op, instruction line) for every collective in the HLO text, in order."""
    out = []
    for line in hlo.splitlines():
        for op, rx in _COLLECTIVE_RE.items():
            if rx.search(line):
                out.append((op, line.strip()))
    return out
