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
    temp, generated code, and the peak (argument + output - alias + temp)."""
    ma = compiled.memory_analysis()
    out = {"argument": int(ma.argument_size_in_bytes), "output": int(ma.output_size_in_bytes),
           "alias": int(ma.alias_size_in_bytes), "temp": int(ma.temp_size_in_bytes),
           "code": int(getattr(ma, "generated_code_size_in_bytes", 0))}
    peak = getattr(ma, "peak_memory_in_bytes", 0) or 0
    out["peak"] = int(peak) or out["argument"] + out["output"] - out["alias"] + out["temp"]
    return out


# ----------------------------------------------------------------------------- HLO

_COMP_RE = re.compile(r"^(?:ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\)|\(.*\))\s*->.*\{\s*$")
_CALLS_RE = re.compile(r"\b(body|condition|calls|to_apply)=%?([\w.\-]+)"
                       r"|\b(?:branch_computations|called_computations)=\{([^}]*)\}")
_DTYPE_BYTES = {"f32": 4, "bf16": 2, "f16": 2, "f64": 8, "s32": 4, "u32": 4, "s8": 1, "u8": 1,
                "pred": 1, "s64": 8, "u64": 8, "s16": 2, "u16": 2, "f8e4m3fn": 1, "f8e5m2": 1}
_SHAPE_RE = re.compile(r"\b(" + "|".join(_DTYPE_BYTES) + r")\[([\d,]*)\]")


def _parse_computations(hlo: str) -> dict[str, list[str]]:
    comps: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        m = _COMP_RE.match(line.strip()) if line and not line.startswith(" ") else None
        if m:
            current = m.group(1)
            comps[current] = []
        elif current is not None:
            if line.strip() == "}":
                current = None
            else:
                comps[current].append(line)
    return comps


def _result_types(line: str) -> list[tuple[str, int]]:
    """(dtype, elements) of an instruction's result (each element of a tuple result)."""
    rhs = line.split("=", 1)[1].strip() if "=" in line else line.strip()
    head = rhs.split(")", 1)[0] if rhs.startswith("(") else rhs.split(" ", 1)[0]
    return [(dt, math.prod(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE_RE.findall(head)]


def collective_report(hlo: str) -> dict[str, Any]:
    """Count collectives in compiled HLO text, split into those inside a while loop
    (the scanned layer loop, or the microbatch loop) and outside.

    Returns {"inside_loop": {op: {"count", "bytes", "dtypes", "op_names"}},
    "outside_loop": {...}}; op_names are the JAX source ops (`transpose(jvp(...))`
    marks the backward pass).
    Bytes are the result sizes per device, counted once per appearance in the
    program (a loop body's collectives run once per iteration).
    """
    comps = _parse_computations(hlo)
    callees: dict[str, set[str]] = defaultdict(set)
    loop_roots: set[str] = set()
    for name, lines in comps.items():
        for line in lines:
            for m in _CALLS_RE.finditer(line):
                names = [m.group(2)] if m.group(2) else [n.strip().lstrip("%") for n in m.group(3).split(",")]
                callees[name].update(names)
                if m.group(1) in ("body", "condition") and " while(" in line:
                    loop_roots.update(names)
    in_loop: set[str] = set()
    stack = list(loop_roots)
    while stack:
        c = stack.pop()
        if c in in_loop:
            continue
        in_loop.add(c)
        stack.extend(callees.get(c, ()))
    report: dict[str, dict[str, dict[str, Any]]] = {"inside_loop": {}, "outside_loop": {}}
    for name, lines in comps.items():
        where = "inside_loop" if name in in_loop else "outside_loop"
        for line in lines:
            for op in COLLECTIVES:
                if re.search(rf"\s{op}(-start)?\(", line):
                    entry = report[where].setdefault(
                        op, {"count": 0, "bytes": 0, "dtypes": Counter(), "op_names": []})
                    entry["count"] += 1
                    m = re.search(r'op_name="([^"]*)"', line)
                    entry["op_names"].append(m.group(1) if m else "")
                    for dt, n in _result_types(line):
                        entry["bytes"] += n * _DTYPE_BYTES[dt]
                        entry["dtypes"][dt] += 1
    for where in report.values():
        for entry in where.values():
            entry["dtypes"] = dict(entry["dtypes"])
    return report


def collective_ops(hlo: str) -> list[tuple[str, str]]:
    """(op, instruction line) for every collective in the HLO text, in order."""
    out = []
    for line in hlo.splitlines():
        for op in COLLECTIVES:
            if re.search(rf"\s{op}(-start)?\(", line):
                out.append((op, line.strip()))
    return out
