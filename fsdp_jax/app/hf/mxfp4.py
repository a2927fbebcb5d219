"""MXFP4 expert weights of a Hugging Face checkpoint (gpt-oss as published), dequantised on import.

A tensor of kind `mx` (`fsdp_jax.app.models.families.gpt_oss.part_weights`: an expert weight
(E, in, out), stored by transformers as it is) may instead be stored as OpenAI's MXFP4 pair
that transformers' `integrations/mxfp4.py` reads, when config.json says
`quantization_config: {quant_method: mxfp4}`:
  <name>_blocks  uint8 (E, out, in / 32, 16): 32 FP4 (e2m1) codes per block, two per byte,
                 the low nibble first
  <name>_scales  uint8 (E, out, in / 32): the block's power of two, 2 ** (s - 127)
value[e, i, o] = FP4[code] * 2 ** (s - 127) for the code of row o, column i. Every such value
is exact in bfloat16 and float32, so the import equals transformers' dequantisation bit for
bit. Export writes the weights unquantised (the dtype of the run), without the
quantization_config.
"""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np

from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile

KIND = "mx"
BLOCK = 32
FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
BLOCKS, SCALES = "_blocks", "_scales"


def quantized(raw: Mapping, bad) -> bool:
    """Whether config.json `raw` says its `mx` tensors are MXFP4; bad(key, ...) for another
    quantisation."""
    q = raw.get("quantization_config")
    if q is None:
        return False
    method = q.get("quant_method") if isinstance(q, Mapping) else None
    if method not in ("mxfp4", "fp8"):
        raise bad(
            "quantization_config",
            "only quant_method mxfp4 (gpt-oss's experts) or fp8 (block-scaled, `fp8_blocks`) is dequantised on import",
        )
    return method == "mxfp4"


def stored(want: dict[str, tuple[int, ...]], names: set[str]) -> tuple[dict, str | None]:
    """(`want` ({HF name: shape}) with each of `names` (E, in, out) replaced by its blocks and
    scales, a problem or None)."""
    out = dict(want)
    for n in sorted(names):
        e, i, o = out.pop(n)
        if i % BLOCK:
            return out, f"tensor {n}: its input dim {i} is not a multiple of MXFP4's block of {BLOCK}"
        out[n + BLOCKS] = (e, o, i // BLOCK, BLOCK // 2)
        out[n + SCALES] = (e, o, i // BLOCK)
    return out, None


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(E, out, G, 16) uint8 codes + (E, out, G) uint8 exponents -> (E, G * 32, out) float32."""
    vals = np.stack([FP4[blocks & 0x0F], FP4[blocks >> 4]], axis=-1).reshape(*blocks.shape[:-1], BLOCK)
    vals = vals * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return vals.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1)


def read_block(
    blocks: SafetensorsFile, scales: SafetensorsFile, name: str, idx: tuple[slice, ...], shape: tuple[int, ...], dtype
) -> np.ndarray:
    """Our (E, in, out) leaf `shape`'s block `idx` of MXFP4 tensor `name`: only the MXFP4
    blocks that cover it are read."""
    (e0, e1, _), (i0, i1, _), (o0, o1, _) = (s.indices(n) for s, n in zip(idx, shape))
    g0, g1 = i0 // BLOCK, -(-i1 // BLOCK)
    b = blocks.read(name + BLOCKS, slice(e0, e1), slice(o0, o1), slice(g0, g1))
    s = scales.read(name + SCALES, slice(e0, e1), slice(o0, o1), slice(g0, g1))
    return dequantize(b, s)[:, i0 - g0 * BLOCK : i1 - g0 * BLOCK].astype(dtype)
