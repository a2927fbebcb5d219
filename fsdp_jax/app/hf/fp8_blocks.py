"""Block-scaled FP8 weights of a Hugging Face checkpoint (DeepSeek-V3 as published), dequantised
on import.

When config.json says `quantization_config: {quant_method: fp8, fmt: e4m3, weight_block_size:
[bm, bn], ...}`, a 2-D weight `<name>` (out, in) may be stored as float8_e4m3fn beside
`<name>_scale_inv` float32 (ceil(out / bm), ceil(in / bn)):
    value[i, j] = fp8[i, j] * scale_inv[i // bm, j // bn]
computed in float32 (DeepSeek's `weight_dequant`; transformers' fine-grained FP8 dequantisation),
then cast to the leaf's dtype. Which weights are FP8 is what the checkpoint holds (a `_scale_inv`
beside it): DeepSeek-V3 keeps its embeddings, head, norms, router and score bias in bf16. Export
writes every weight unquantised (the run's dtype), without the quantization_config.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile

SCALE = "_scale_inv"
DTYPE = "float8_e4m3fn"


def block_size(raw: Mapping, bad) -> tuple[int, int] | None:
    """(bm, bn) when config.json `raw` says its weights are block-scaled FP8, else None;
    bad(key, why) for an FP8 quantization_config this import does not read."""
    q = raw.get("quantization_config")
    if not isinstance(q, Mapping) or q.get("quant_method") != "fp8":
        return None
    if q.get("fmt", "e4m3") != "e4m3":
        raise bad("quantization_config.fmt", f"{q.get('fmt')!r}: only e4m3 (float8_e4m3fn) weights are read")
    size = q.get("weight_block_size")
    if not (isinstance(size, list) and len(size) == 2 and all(type(n) is int and n > 0 for n in size)):
        raise bad("quantization_config.weight_block_size", f"{size!r}: expected two positive integers [rows, cols]")
    return size[0], size[1]


def scale_shape(shape: tuple[int, ...], block: tuple[int, int]) -> tuple[int, int]:
    """The `_scale_inv` shape of a weight of `shape` (out, in)."""
    return -(-shape[0] // block[0]), -(-shape[1] // block[1])


def problem(name: str, f: SafetensorsFile, scales: SafetensorsFile, shape: tuple[int, ...], block) -> str | None:
    """None, or what is wrong with FP8 weight `name` (expected `shape`) and its scales."""
    if len(shape) != 2:
        return f"tensor {name}: FP8 with {name}{SCALE} on a {len(shape)}-D weight (block scales are 2-D)"
    if f.dtype(name).name != DTYPE:
        return f"tensor {name} has dtype {f.dtype(name)} beside {name}{SCALE}, expected {DTYPE}"
    want = scale_shape(shape, block)
    if scales.shape(name + SCALE) != want or scales.dtype(name + SCALE).kind != "f":
        got = (list(scales.shape(name + SCALE)), scales.dtype(name + SCALE))
        return f"tensor {name}{SCALE} has shape {got[0]} ({got[1]}), weight_block_size implies {list(want)} (float)"
    return None


class Fp8Weight:
    """A reader of one FP8 weight's dequantised values: `read(name, rows, cols, dtype=)` as
    `SafetensorsFile.read`, reading only the scale blocks the slice covers."""

    def __init__(self, f: SafetensorsFile, scales: SafetensorsFile, block: tuple[int, int]):
        self.f, self.scales, self.block = f, scales, block

    def read(self, name: str, *index: slice | None, dtype=None) -> np.ndarray:
        shape = self.f.shape(name)
        spans = [(s or slice(None)).indices(n)[:2] for s, n in zip(tuple(index) + (None, None), shape)]
        (r0, r1), (c0, c1) = spans
        (bm, bn), (g0, h0) = self.block, (r0 // self.block[0], c0 // self.block[1])
        q = self.f.read(name, slice(r0, r1), slice(c0, c1), dtype=np.float32)
        s = self.scales.read(name + SCALE, slice(g0, -(-r1 // bm)), slice(h0, -(-c1 // bn)), dtype=np.float32)
        s = np.repeat(np.repeat(s, bm, axis=0), bn, axis=1)[r0 - g0 * bm : r1 - g0 * bm, c0 - h0 * bn : c1 - h0 * bn]
        out = q * s
        return out if dtype is None else out.astype(dtype)
