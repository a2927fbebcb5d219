"""Grouped GEMMs in a compiled program: the kernel custom calls of a ragged dot (tokamax's
Pallas kernels: Triton `__gpu$xla.gpu.triton`, Mosaic GPU `mosaic_gpu*`; XLA:TPU's own grouped
matmul, a `tpu_custom_call` named `ragged-dot-*`), described as the groups they compute (XLA's
cost analysis counts tokamax's as 0 FLOPs; the op inventory read XLA:TPU's as a memory op).

    rec = grouped_gemm(line, result_type)   # None unless `line` is such a call

A ragged dot has one 3-D operand or result, the groups' weights (G, A, B) or their gradient,
and two 2-D ones of M rows each, one with A columns and one with B (x (M, A) -> y (M, B);
dy (M, B) -> dx (M, A); x, dy -> dw (G, A, B); either may be transposed). Each of the M rows
meets one group's A x B matrix, so the FLOPs are 2 M A B: those of the rows the groups hold
(rows in no group, the tail a kernel skips, are counted too: an upper bound by that tail).
"""

from __future__ import annotations

import math
import re
from typing import Any

from fsdp_jax.hlo.types import DTYPE_BYTES

KERNEL_TARGETS = ("__gpu$xla.gpu.triton", "mosaic_gpu", "tpu_custom_call")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_RAGGED_RE = re.compile(r'op_name="[^\n]*?(?:RaggedDot|ragged_dot|ragged-dot-)')  # its quotes escaped inside
_FLOAT_RE = re.compile(r"\b(bf16|f16|f32|f8e4m3fn|f8e5m2)\[([\d,]+)\]")


def _constraints(line: str) -> str:
    """The text of `operand_layout_constraints={...}` (braces matched), or ''."""
    start = line.find("operand_layout_constraints={")
    if start < 0:
        return ""
    i, depth = start + len("operand_layout_constraints="), 0
    for j in range(i, len(line)):
        depth += {"{": 1, "}": -1}.get(line[j], 0)
        if depth == 0:
            return line[i + 1 : j]
    return ""


def _floats(text: str) -> list[tuple[str, list[int]]]:
    return [(dt, [int(d) for d in dims.split(",")]) for dt, dims in _FLOAT_RE.findall(text)]


def grouped_gemm(line: str, result_type: str) -> dict[str, Any] | None:
    """A gemm record (`m`, `n`, `k`, `batch`, `groups`, `dtype`, `flops`, `bytes`) for a ragged
    dot's kernel call, or None. m x n is the output each kernel writes (per group for a weight
    gradient: batch = groups), k the contracted size."""
    target = _TARGET_RE.search(line)
    if not target or not any(t in target.group(1) for t in KERNEL_TARGETS) or not _RAGGED_RE.search(line):
        return None
    operands, result = _floats(_constraints(line)), _floats(result_type)
    arrays = operands + result
    three = [d for _, d in arrays if len(d) == 3]
    two = [d for _, d in arrays if len(d) == 2]
    if len(three) != 1 or len(two) != 2 or not result:
        return None
    g, a, b = three[0]
    rows, rem = divmod(sum(math.prod(d) for d in two), a + b)
    if rem or rows <= 0:
        return None
    out = result[0][1]
    if len(out) == 3:  # a weight gradient: per group an (A, B) output over its rows (M / G on average)
        m, n, k, batch = a, b, max(rows // g, 1), g
    else:
        m, n, batch = out[0], out[1], 1
        k = a * b // n
    nbytes = sum(math.prod(d) * DTYPE_BYTES.get(dt, 2) for dt, d in arrays)
    dtype = (operands or result)[0][0]
    return {
        "m": m,
        "n": n,
        "k": k,
        "batch": batch,
        "groups": g,
        "dtype": dtype,
        "flops": 2 * rows * a * b,
        "bytes": nbytes,
    }
