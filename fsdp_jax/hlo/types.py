"""The element types of an HLO instruction's result: bytes per dtype, and the (dtype,
element count) of each buffer a collective produces, from the type text of its line
(`f32[8,128]`, tuples, async `-start` pairs). `fsdp_jax.hlo.schedule` sizes its collective
records with these (and re-exports `result_shapes`)."""

from __future__ import annotations

import math
import re

DTYPE_BYTES = {
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
DTYPE_NAMES = {"f32": "float32", "bf16": "bfloat16", "f16": "float16", "f64": "float64"}
_SHAPE_RE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")


def top_level(s: str) -> list[str]:
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


def type_dims(type_str: str) -> list[int]:
    """The dims of the first array type in `type_str`."""
    m = re.search(r"\[([\d,]*)\]", type_str)
    return [int(d) for d in m.group(1).split(",") if d] if m else []


def type_shapes(type_str: str) -> list[tuple[str, int]]:
    return [(dt, math.prod(int(d) for d in dims.split(",") if d)) for dt, dims in _SHAPE_RE.findall(type_str)]


def result_shapes(type_str: str, op: str, is_start: bool) -> list[tuple[str, int]]:
    """(dtype, elements) of what a collective produces. An async `-start` that returns
    ((operands), results) keeps the results: all-gather, reduce-scatter and all-to-all on
    every XLA (with one operand the start returns (operand, result)), and all-reduce from XLA 0.12 on (before, its start returned the result alone)."""
    if is_start and type_str.startswith("(("):
        parts = top_level(type_str)
        if len(parts) >= 2:
            return type_shapes(parts[1])
    if is_start and op in ("all-gather", "reduce-scatter", "all-to-all") and type_str.startswith("("):
        parts = top_level(type_str)  # one operand: (operand, result)
        if len(parts) == 2:
            return type_shapes(parts[1])
    if is_start and op == "collective-permute":
        parts = top_level(type_str)
        return type_shapes(parts[1] if len(parts) >= 2 else type_str)
    return type_shapes(type_str)
