"""bitsandbytes' quantisers, bit for bit, in NumPy and JAX (`xp` is either module).

- NF4 (`nf4_quantize`): 16 code values (`NF4`, the normal-float quantiles of QLoRA),
  blockwise absmax: each block of `block` consecutive elements is divided by its largest
  |x| and each element takes the nearest code, a value on a midpoint the lower one
  (`quantize_4bit`'s bucketize); two codes per byte, the first in the high nibble.
- Blockwise 8-bit (`blockwise_quantize`): the same with the 256-value dynamic map
  (`dynamic_map()`, `create_dynamic_map`), as `quantize_blockwise` does on the CPU; double
  quantisation (`compress_statistics`) runs it on NF4's absmax minus their mean, block 256.
- int8 per channel (`int8_quantize`): round(x * 127 / absmax) with the absmax over the
  `reduce` dims (`int8_vectorwise_quant`'s rows are a torch weight's output channels); an all-zero
  channel codes to 0 (bitsandbytes would divide by zero).

Inputs are flat (or any shape, read in row-major order); everything computes in float32 as
bitsandbytes does, so a bf16 or fp16 tensor quantises as its float32 values. Golden tests
(tests/test_qlora_codes.py) hold these against bitsandbytes 0.50's own output.
"""

from __future__ import annotations

import numpy as np

# bitsandbytes.functional.get_4bit_type("nf4"): float32 values, sorted
NF4 = np.array(
    [
        -1.0,
        -0.6961928009986877,
        -0.5250730514526367,
        -0.39491748809814453,
        -0.28444138169288635,
        -0.18477343022823334,
        -0.09105003625154495,
        0.0,
        0.07958029955625534,
        0.16093020141124725,
        0.24611230194568634,
        0.33791524171829224,
        0.44070982933044434,
        0.5626170039176941,
        0.7229568362236023,
        1.0,
    ],
    np.float32,
)
_TINY = np.float32(1e-38)  # bitsandbytes' clamp of an all-zero block's absmax


def _linspace_f32(start: float, stop: float, n: int) -> np.ndarray:
    """torch.linspace(start, stop, n, dtype=float32) on the CPU: a float32 step, each value
    start + step * i (first half) or stop - step * (n - 1 - i) rounded once (a fused
    multiply-add; float64 here), checked against torch's table by the dynamic map's golden."""
    start32, stop32 = np.float32(start), np.float32(stop)
    step = np.float64(np.float32((stop32 - start32) / np.float32(n - 1)))
    i = np.arange(n, dtype=np.float64)
    lo = np.float64(start32) + step * i
    hi = np.float64(stop32) - step * (n - 1 - i)
    return np.where(i < n // 2, lo, hi).astype(np.float32)


def dynamic_map(max_exponent_bits: int = 7, total_bits: int = 8) -> np.ndarray:
    """bitsandbytes' `create_dynamic_map(signed=True)`: 256 sorted float32 values in [-1, 1]."""
    data: list[np.ndarray] = []
    non_sign = total_bits - 1
    extra = 2 ** (non_sign - max_exponent_bits) - 1
    for i in range(max_exponent_bits):
        b = _linspace_f32(0.1, 1.0, 2 ** (i + non_sign - max_exponent_bits) + 1)
        means = (b[:-1] + b[1:]) / np.float32(2.0)
        data += [np.float32(10 ** (-(max_exponent_bits - 1) + i)) * means]
        data += [np.float32(-(10 ** (-(max_exponent_bits - 1) + i))) * means]
    if extra > 0:  # none for the default 7 exponent bits
        raise NotImplementedError("dynamic_map: only max_exponent_bits = total_bits - 1")
    vals = np.concatenate(data + [np.array([0.0, 1.0], np.float32)])
    vals = np.concatenate([vals, np.zeros(256 - vals.size, np.float32)])
    return np.sort(vals).astype(np.float32)


DYNAMIC = dynamic_map()


def _blocks(xp, x, block: int):
    """x flattened to float32 and padded with zeros to (n_blocks, block); and n."""
    flat = xp.reshape(x, (-1,)).astype(xp.float32)
    n = flat.shape[0]
    pad = -n % block
    if pad:
        flat = xp.concatenate([flat, xp.zeros((pad,), xp.float32)])
    return xp.reshape(flat, (-1, block)), n


def _scaled(xp, blocks, n: int, block: int):
    """(x / absmax per block, clipped to [-1, 1]; absmax), as bitsandbytes computes them:
    times the reciprocal for full blocks, divided for a partial last one."""
    absmax = xp.max(xp.abs(blocks), axis=1)
    safe = xp.maximum(absmax, _TINY)
    # an all-zero block scales by 0, not 1 / 1e-38: XLA flushes that denormal to zero (0 * inf)
    scaled = blocks * xp.where(absmax > 0, xp.float32(1.0) / safe, xp.float32(0.0))[:, None]
    if n % block:
        last = blocks[-1] / safe[-1]
        scaled = xp.concatenate([scaled[:-1], last[None]], axis=0)
    return xp.clip(scaled, -1.0, 1.0), absmax


def nf4_quantize(xp, x, block: int = 64):
    """bitsandbytes' `quantize_4bit(x, blocksize=block, quant_type="nf4")`: (packed codes
    uint8 (ceil(n / 2),), absmax float32 (ceil(n / block),))."""
    blocks, n = _blocks(xp, x, block)
    scaled, absmax = _scaled(xp, blocks, n, block)
    bounds = xp.asarray((NF4[:-1] + NF4[1:]) / np.float32(2.0))
    q = xp.searchsorted(bounds, xp.reshape(scaled, (-1,))[: n + n % 2], side="left").astype(xp.uint8)
    if n % 2:
        q = xp.concatenate([q[:-1], xp.asarray([7], xp.uint8)])  # torch pads the scaled values with 0: code 7
    return pack_nibbles(xp, q), absmax


def pack_nibbles(xp, q):
    """4-bit codes (..., 2k) -> bytes (..., k): the first of each pair in the high nibble."""
    q = q.astype(xp.uint8)
    return (q[..., 0::2] << 4) | q[..., 1::2]


def unpack_nibbles(xp, packed):
    """bytes (..., k) -> 4-bit codes (..., 2k) (`pack_nibbles`' inverse)."""
    hi, lo = packed >> 4, packed & 0xF
    return xp.reshape(xp.stack([hi, lo], axis=-1), packed.shape[:-1] + (2 * packed.shape[-1],))


def nf4_dequantize(xp, packed, absmax, n: int, block: int = 64):
    """bitsandbytes' `dequantize_4bit` (nf4): float32 (n,) = NF4[code] * its block's absmax."""
    vals = xp.asarray(NF4)[unpack_nibbles(xp, xp.reshape(packed, (-1,))).astype(xp.int32)][:n]
    return vals * xp.repeat(xp.reshape(absmax, (-1,)), block)[:n]


def blockwise_quantize(xp, x, block: int = 256, code=None):
    """bitsandbytes' `quantize_blockwise(x, blocksize=block)` (dynamic map) as its portable
    backend computes it: (codes uint8 (n,), absmax float32 (ceil(n / block),)), the nearest
    code to x times the block's reciprocal absmax (divided for a partial last block), the
    lower one on a tie. Its CPU C++ kernel (a vectorised bin search) picks another code for
    a few values (exact zeros among them); tests/test_qlora_codes.py counts them."""
    code = DYNAMIC if code is None else code
    blocks, n = _blocks(xp, x, block)
    scaled, absmax = _scaled(xp, blocks, n, block)
    bounds = xp.asarray((code[:-1] + code[1:]) / np.float32(2.0))
    return xp.searchsorted(bounds, xp.reshape(scaled, (-1,))[:n], side="left").astype(xp.uint8), absmax


def blockwise_dequantize(xp, codes, absmax, n: int, block: int = 256, code=None):
    """bitsandbytes' `dequantize_blockwise`: float32 (n,) = code[c] * its block's absmax."""
    code = DYNAMIC if code is None else code
    vals = xp.asarray(code)[xp.reshape(codes, (-1,)).astype(xp.int32)]
    return vals * xp.repeat(xp.reshape(absmax, (-1,)), block)[:n]


def int8_quantize(xp, x, reduce: tuple[int, ...]):
    """bitsandbytes' `int8_vectorwise_quant` (threshold 0) with the absmax over `reduce`
    (kept as size-1 dims): (codes int8, x's shape; absmax float32)."""
    x32 = x.astype(xp.float32)
    absmax = xp.max(xp.abs(x32), axis=reduce, keepdims=True)
    # torch's CPU kernel divides a scalar by a tensor as scalar * (1 / tensor): two roundings
    scale = xp.float32(127.0) * xp.where(absmax > 0, xp.float32(1.0) / xp.maximum(absmax, _TINY), xp.float32(0.0))
    return xp.round(x32 * scale).astype(xp.int8), absmax


def int8_dequantize(xp, codes, absmax):
    """float32 codes * absmax / 127 (bitsandbytes' `int8_vectorwise_dequant`)."""
    return codes.astype(xp.float32) * (absmax * xp.float32(1.0 / 127.0))
