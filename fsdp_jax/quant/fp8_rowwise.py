"""FP8 matmuls with rowwise (axiswise) scales: torchtitan's `rowwise` float8 recipe
(torchao `Float8LinearRecipeName.ROWWISE`: every operand e4m3 with a scale per row or column
along the contracted dim, scales rounded down to a power of two), docs/fp8.md.

For x (M, K) (leading dims flattened), w (K, N), output gradient g (M, N), each GEMM casts
its operands along the dim it contracts:

    forward   y  = (dot(e4m3(x sx), e4m3(w sw)) in f32, written in x's dtype) * (1 / (sx sw))
              sx (M, 1): per token, over K;  sw (1, N): per output column, over K
    input     dx = dot(e4m3(g sg), e4m3(w sv)^T) * (1 / (sg sv^T))
              sg (M, 1): per token, over N;  sv (K, 1): per row of w, over N
    weight    dw = dot(e4m3(x su)^T, e4m3(g sh)) * (1 / (su^T sh))
              su (1, K): per column of x, over M;  sh (1, N): per column of g, over M

each scale `p2(448 / amax)` (`p2`: the largest power of two not above it; 1 for an amax of 0
or a non-finite one), f32 accumulation. The backward casts the saved input and weight again
along its own dims, as torchao does, so it keeps them in their own dtype. The code casts the
weight after the FSDP gather (torchao's float8 all-gather takes tensorwise scales only);
XLA:GPU moves the forward's per-column cast before the gather by itself (docs/fp8.md).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fsdp_jax.quant.fp8 import E4M3, quantize, scale_for

_EXPONENT = 0x7F800000  # float32's exponent bits: a positive normal number without them is its power of two


def pow2_scale(a) -> jax.Array:
    """`scale_for(a, e4m3)` rounded down to a power of two (torchao's
    `round_scales_to_power_of_2`), by clearing the float32 mantissa bits."""
    s = scale_for(a, E4M3)
    bits = jax.lax.bitcast_convert_type(s, jnp.int32) & jnp.int32(_EXPONENT)
    return jax.lax.bitcast_convert_type(bits, jnp.float32)


def _axis_amax(a, axis: int) -> jax.Array:
    return jax.lax.stop_gradient(jnp.max(jnp.abs(a.astype(jnp.float32)), axis=axis, keepdims=True))


def _cast(a, axis: int):
    """(e4m3 of `a` scaled along `axis`, the scales with `axis` kept as a size-1 dim)."""
    s = pow2_scale(_axis_amax(a, axis))
    return quantize(a, s, E4M3), s


def _dot(a, b, out=jnp.float32):
    return jax.lax.dot_general(a, b, (((1,), (0,)), ((), ())), preferred_element_type=out)


@functools.lru_cache(maxsize=None)
def _make(reduce_dtype):
    @jax.custom_vjp
    def f(x, w):
        return fwd(x, w)[0]

    def fwd(x, w):
        xq, sx = _cast(x, 1)  # (M, 1)
        wq, sw = _cast(w, 0)  # (1, N)
        y = _dot(xq, wq, x.dtype) * (1.0 / (sx * sw))
        return y.astype(x.dtype), (x, w)

    def bwd(res, g):
        x, w = res
        gq, sg = _cast(g, 1)  # (M, 1) over N
        vq, sv = _cast(w, 1)  # (K, 1) over N
        dx = (_dot(gq, vq.T) * (1.0 / (sg * sv.T))).astype(x.dtype)
        uq, su = _cast(x, 0)  # (1, K) over M
        hq, sh = _cast(g, 0)  # (1, N) over M
        dw = _dot(uq.T, hq) * (1.0 / (su.T * sh))
        if reduce_dtype.itemsize > w.dtype.itemsize:  # reduced across devices in the wider dtype
            dw = jax.lax.optimization_barrier(dw.astype(reduce_dtype))
        return dx, dw.astype(w.dtype)

    f.defvjp(fwd, bwd)
    return f


def rowwise_matmul(x, w, *, reduce_dtype=None) -> jax.Array:
    """`x @ w` (x (..., K), w (K, N)) through FP8 with rowwise scales (module docstring), in
    x's dtype; `reduce_dtype` the weight gradient's before the cross-device reduction (None: w's)."""
    r = jnp.dtype(reduce_dtype if reduce_dtype is not None else w.dtype)
    lead = x.shape[:-1]
    y = _make(r)(x.reshape(-1, x.shape[-1]), w)
    return y.reshape(*lead, w.shape[-1])
