"""A frozen weight stored quantised: the leaves a model keeps, shards and gathers in place of
the weight, and the dequantisation a layer runs on its gathered leaves.

    spec = QuantSpec("nf4", block=64, double=True)
    leaves = quantize(jnp, w, spec, depth=1, n_in=1)   # w (L, D, F) -> {"codes", "absmax_codes", ...}
    w_l = dequantize(jnp, sliced_leaves, spec, jnp.bfloat16)   # one layer's (D, F), in the compute dtype

Layout (a weight `w` of shape stack dims (`depth` of them, a scanned stack's layers) + its
own dims; blocks run along its last dim, so each block of one layer is bitsandbytes' block
of that layer's tensor flattened):
- nf4: `codes` uint8 (..., last / 2), two codes per byte; `absmax` (..., last / block) or,
  `double`, `absmax_codes` uint8 (..., last / block) with `absmax2` (stack..., blocks of
  256 of one layer's absmax) and `offset` (stack...): bitsandbytes' compress_statistics,
  per layer.
- int8: `codes` int8 as `w`; `absmax` per output channel, w's shape with its first `n_in`
  own dims (the contracted ones) of size 1.
Float statistics are stored as the bits of their float32 values (uint32): the leaves are all
integers, so no precision policy casts them, no gradient reaches them and an optimizer keeps
no state for them. Logical names: the weight's for `codes` / `absmax` (/ `absmax_codes`),
the stack's for `absmax2` and `offset` (tiny: replicated within a layer).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import numpy as np

from fsdp_jax.quant.codes import (
    DYNAMIC,
    NF4,
    blockwise_quantize,
    int8_dequantize,
    int8_quantize,
    nf4_quantize,
    unpack_nibbles,
)

SCHEMES = ("nf4", "int8")
DQ_BLOCK = 256  # bitsandbytes' block for the double quantisation of the absmax


@dataclasses.dataclass(frozen=True)
class QuantSpec:
    """How a frozen base is quantised: `scheme` (nf4 | int8), NF4's `block` and `double`
    quantisation of its absmax."""

    scheme: str
    block: int = 64
    double: bool = False

    def __post_init__(self):
        if self.scheme not in SCHEMES:
            raise ValueError(f"unknown quantisation scheme {self.scheme!r}; the schemes are {', '.join(SCHEMES)}")
        if not (isinstance(self.block, int) and self.block >= 2 and self.block % 2 == 0):
            raise ValueError(f"quantisation block must be an even integer >= 2, got {self.block!r}")

    @property
    def label(self) -> str:
        """The scheme as a checkpoint records it: `nf4/64/dq`, `nf4/64`, `int8`."""
        if self.scheme == "int8":
            return "int8"
        return f"nf4/{self.block}" + ("/dq" if self.double else "")

    def problem(self, name: str, shape: tuple[int, ...], depth: int = 0) -> str | None:
        """None, or why weight `name` of `shape` (with `depth` stack dims) cannot be
        quantised this way: its last dim smaller than a block, or not a multiple of it."""
        if self.scheme != "nf4":
            return None
        last = shape[-1]
        if last < self.block:
            return f"{name}'s last dim ({last}) is smaller than the block ({self.block})"
        if last % self.block:
            return f"the block ({self.block}) does not divide {name}'s last dim ({last})"
        return None


def _bits(xp, x):
    return x.astype(xp.float32).view(xp.uint32) if xp is np else jax.lax.bitcast_convert_type(x, np.uint32)


def _float(xp, b):
    return b.view(np.float32) if xp is np else jax.lax.bitcast_convert_type(b, np.float32)


def quantize(xp, w, spec: QuantSpec, depth: int = 0, n_in: int = 1) -> dict:
    """`w` (stack dims..., own dims...) as its quantised leaves (the module docstring)."""
    if spec.scheme == "int8":
        codes, absmax = int8_quantize(xp, w, tuple(range(depth, depth + n_in)))
        return {"codes": codes, "absmax": _bits(xp, absmax)}
    lead, last = tuple(w.shape[:-1]), w.shape[-1]
    packed, absmax = nf4_quantize(xp, w, spec.block)  # blocks along the last dim: per layer = bnb's
    codes = xp.reshape(packed, lead + (last // 2,))
    absmax = xp.reshape(absmax, lead + (last // spec.block,))
    if not spec.double:
        return {"codes": codes, "absmax": _bits(xp, absmax)}
    stack = tuple(w.shape[:depth])
    rows = xp.reshape(absmax, (math.prod(stack), -1))  # one layer's absmax per row
    per_layer = [_double(xp, r) for r in (rows[i] for i in range(rows.shape[0]))]
    return {
        "codes": codes,
        "absmax_codes": xp.reshape(xp.stack([q for q, _, _ in per_layer]), absmax.shape),
        "absmax2": _bits(xp, xp.reshape(xp.stack([a for _, a, _ in per_layer]), stack + (-1,))),
        "offset": _bits(xp, xp.reshape(xp.stack([o for _, _, o in per_layer]), stack)),
    }


def _double(xp, absmax):
    """bitsandbytes' compress_statistics of one tensor's absmax: (codes, absmax2, offset).
    The offset is the absmax' mean: in NumPy summed in float64 and rounded once (torch's
    float32 mean on every golden); in JAX a float32 sum in XLA's order, which may differ in
    its last bit (then the codes are those of that offset; dequantising adds it back)."""
    offset = xp.mean(absmax.astype(xp.float64 if xp is np else xp.float32)).astype(xp.float32)
    codes, absmax2 = blockwise_quantize(xp, absmax - offset, DQ_BLOCK)
    return codes, absmax2, offset


def dequantize(xp, leaves: dict, spec: QuantSpec, dtype=np.float32):
    """The weight the `leaves` hold (any stack dims left on them), float32 products cast
    once to `dtype`, as bitsandbytes' dequantize does."""
    codes = leaves["codes"]
    if spec.scheme == "int8":
        return int8_dequantize(xp, codes, _float(xp, leaves["absmax"])).astype(dtype)
    absmax = _absmax(xp, leaves)
    vals = xp.asarray(NF4)[unpack_nibbles(xp, codes).astype(xp.int32)]
    return (vals * xp.repeat(absmax, spec.block, axis=-1)).astype(dtype)


def _absmax(xp, leaves: dict):
    if "absmax" in leaves:
        return _float(xp, leaves["absmax"])
    q, offset = leaves["absmax_codes"], _float(xp, leaves["offset"])
    absmax2 = _float(xp, leaves["absmax2"])
    stack = offset.shape
    flat = xp.reshape(q, stack + (-1,))
    m = flat.shape[-1]
    pad = -m % DQ_BLOCK
    if pad:
        flat = xp.concatenate([flat, xp.zeros(stack + (pad,), flat.dtype)], axis=-1)
    vals = xp.asarray(DYNAMIC)[flat.astype(xp.int32)]
    vals = xp.reshape(vals, stack + (-1, DQ_BLOCK)) * absmax2[..., None]
    out = xp.reshape(vals, stack + (-1,))[..., :m] + offset[..., None]
    return xp.reshape(out, q.shape)


def leaf_shapes(shape: tuple[int, ...], dtype, spec: QuantSpec, depth: int = 0, n_in: int = 1) -> dict:
    """`quantize`'s leaves as ShapeDtypeStructs, without computing them."""
    w = jax.ShapeDtypeStruct(tuple(shape), dtype)
    return jax.eval_shape(lambda x: quantize(jax.numpy, x, spec, depth, n_in), w)


def leaf_names(names, spec: QuantSpec, depth: int = 0, n_in: int = 1) -> dict:
    """Logical names of each leaf, from the weight's `names` (stack dims' names first)."""
    names = tuple(names)
    if spec.scheme == "int8":
        return {"codes": names, "absmax": names[:depth] + (None,) * n_in + names[depth + n_in :]}
    out = {"codes": names, ("absmax_codes" if spec.double else "absmax"): names}
    if spec.double:
        out.update(absmax2=names[:depth] + (None,), offset=names[:depth])
    return out
