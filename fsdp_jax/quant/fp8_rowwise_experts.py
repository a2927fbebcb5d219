"""Routed experts' GEMMs with rowwise (axiswise) FP8 scales: the `rowwise` recipe
(`fsdp_jax.quant.fp8_rowwise`) per expert, as torchtitan's MoE FP8 scales its grouped GEMMs
through torchao's `_scaled_grouped_mm` (per token, and per expert and output column), docs/fp8.md.

Two layouts, as `fsdp_jax.quant.fp8_experts`: grouped rows `x` (M, K) sorted by expert with `w`
(E, K, N) and `sizes` (E,) (`jax.lax.ragged_dot`; rows past sum(sizes) in no expert), or batched
`x` (E, C, K). Every operand e4m3, every scale `pow2_scale(amax)` along the dim its GEMM
contracts; for a row r of expert e:

    forward   y_r  = (dot(e4m3(x_r sx_r), e4m3(w[e] sw_e)) in f32, in x's dtype) * (1 / (sx_r sw_e))
              sx_r: per row, over K;  sw_e (1, N): per output column of w[e], over K
    input     dx_r = dot(e4m3(g_r sg_r), e4m3(w[e] sv_e)^T) * (1 / (sg_r sv_e^T))
              sg_r: per row, over N;  sv_e (K, 1): per row of w[e], over N
    weight    dw[e] = dot(e4m3(x_e su_e)^T, e4m3(g_e sh_e)) * (1 / (su_e^T sh_e))
              su_e (1, K), sh_e (1, N): per column, over expert e's rows

f32 accumulation. The weight gradient's column scales span all of an expert's rows: inside the
MoE layer's `shard_map` they are maxed over the mesh axes the rows vary over and the weight
does not, as `fp8_experts` does; the per-row scales need no exchange.

With a `gather` (`fp8_expert_gather`: w is its at-rest shard, under full_shard / hybrid_shard)
each GEMM that takes w casts the shard along the dim it contracts and all-gathers the e4m3 data
with its scales: where the gathered dim is the contracted one the shards' amaxes are maxed
across the gather axes (an (E, 1, N) or (E, K, 1) all-reduce), otherwise the scales are the
shard's own and are all-gathered beside the data. The forward gathers w cast per output column,
the backward the shard again cast per row (torchao keeps rowwise weights out of its float8
all-gather, which takes tensorwise scales only; these are the same casts as on the gathered
weight, so a max being exact, the same e4m3 values). The weight gradient is reduce-scattered
back to the shard in the reduce dtype.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fsdp_jax.quant import fp8_expert_gather
from fsdp_jax.quant.fp8 import E4M3, quantize
from fsdp_jax.quant.fp8_expert_gather import Gather
from fsdp_jax.quant.fp8_experts import DW_DIMS, finish_dw, group_ids, pmax_over, shared_weight
from fsdp_jax.quant.fp8_rowwise import pow2_scale
from fsdp_jax.sharding import precision


def _amax(a, axis) -> jax.Array:
    return jnp.max(jnp.abs(a.astype(jnp.float32)), axis=axis, keepdims=True)


def _rows_of(v, gid) -> jax.Array:
    """Per-expert (E, X) values as (M, X) for rows of experts `gid` (ones past the groups)."""
    return jnp.concatenate([v, jnp.ones((1, v.shape[-1]), v.dtype)])[gid]


def _group_col_scale(a, gid, n: int, axes) -> jax.Array:
    """(E, X) scales per expert and column of `a` (M, X), over each expert's rows (all devices')."""
    m = jax.ops.segment_max(jnp.abs(a.astype(jnp.float32)), gid, num_segments=n + 1)[:n]
    return pow2_scale(pmax_over(jnp.maximum(m, 0.0), axes))


def _weight(w, axis: int, gather: Gather):
    """(e4m3 of the expert weight `w` (E, K, N) cast per expert along `axis` (1: per output
    column, over K; 2: per row, over N), its scales with `axis` kept as a size-1 dim): with a
    `gather`, `w` is the at-rest shard, cast there and its e4m3 data and scales all-gathered."""
    a = _amax(w, axis)
    a = pmax_over(a, tuple(ax for d, axes in gather if d == axis for ax in axes))  # the shards' max
    s = pow2_scale(a)
    wq = fp8_expert_gather.all_gather(quantize(w, s, E4M3), gather)
    return wq, fp8_expert_gather.all_gather(s, tuple((d, axes) for d, axes in gather if d != axis))


@functools.lru_cache(maxsize=None)
def _grouped(reduce_dtype, axes: tuple[str, ...], gather: Gather):
    @jax.custom_vjp
    def f(x, w, sizes):
        return fwd(x, w, sizes)[0]

    def fwd(x, w, sizes):
        gid = group_ids(sizes, x.shape[0])
        sx = pow2_scale(_amax(x, 1))  # (M, 1)
        xq, (wq, sw) = quantize(x, sx, E4M3), _weight(w, 1, gather)  # sw (E, 1, N)
        y = jax.lax.ragged_dot(xq, wq, sizes, preferred_element_type=x.dtype) * (1.0 / (sx * _rows_of(sw[:, 0], gid)))
        return y.astype(x.dtype), (x, w, sizes)

    def bwd(res, g):
        x, w, sizes = res
        gid, n = group_ids(sizes, x.shape[0]), w.shape[0]
        sg = pow2_scale(_amax(g, 1))  # (M, 1)
        gq, (vq, sv) = quantize(g, sg, E4M3), _weight(w, 2, gather)  # sv (E, K, 1)
        dx = jax.lax.ragged_dot(gq, jnp.swapaxes(vq, 1, 2), sizes, preferred_element_type=jnp.float32)
        dx = (dx * (1.0 / (sg * _rows_of(sv[..., 0], gid)))).astype(x.dtype)
        su, sh = _group_col_scale(x, gid, n, axes), _group_col_scale(g, gid, n, axes)  # (E, K), (E, N)
        uq, hq = quantize(x, _rows_of(su, gid), E4M3), quantize(g, _rows_of(sh, gid), E4M3)
        dw = jax.lax.ragged_dot_general(uq, hq, sizes, DW_DIMS, preferred_element_type=jnp.float32)
        dw = dw * (1.0 / (su[:, :, None] * sh[:, None, :]))
        return dx, finish_dw(dw, reduce_dtype, w.dtype, gather, axes), None

    f.defvjp(fwd, bwd)
    return f


def _bdot(a, b, contract, out=jnp.float32):
    return jax.lax.dot_general(a, b, (contract, ((0,), (0,))), preferred_element_type=out)


@functools.lru_cache(maxsize=None)
def _batched(reduce_dtype, axes: tuple[str, ...], gather: Gather):
    @jax.custom_vjp
    def f(x, w):
        return fwd(x, w)[0]

    def fwd(x, w):
        sx, (wq, sw) = pow2_scale(_amax(x, 2)), _weight(w, 1, gather)  # (E, C, 1), (E, 1, N)
        y = _bdot(quantize(x, sx, E4M3), wq, ((2,), (1,)), x.dtype) * (1.0 / (sx * sw))
        return y.astype(x.dtype), (x, w)

    def bwd(res, g):
        x, w = res
        sg, (vq, sv) = pow2_scale(_amax(g, 2)), _weight(w, 2, gather)  # (E, C, 1), (E, K, 1)
        dx = _bdot(quantize(g, sg, E4M3), vq, ((2,), (2,)))
        dx = (dx * (1.0 / (sg * jnp.swapaxes(sv, 1, 2)))).astype(x.dtype)
        su, sh = (
            pow2_scale(pmax_over(_amax(x, 1), axes)),
            pow2_scale(pmax_over(_amax(g, 1), axes)),
        )  # (E, 1, K), (E, 1, N)
        dw = _bdot(quantize(x, su, E4M3), quantize(g, sh, E4M3), ((1,), (1,)))
        dw = dw * (1.0 / (jnp.swapaxes(su, 1, 2) * sh))
        return dx, finish_dw(dw, reduce_dtype, w.dtype, gather, axes)

    f.defvjp(fwd, bwd)
    return f


def grouped_matmul(x, w, sizes, gather: Gather = ()):
    """x (M, K) rows sorted by expert, w (E, K, N), sizes (E,) int32 -> (M, N) in x's dtype,
    rowwise FP8 per expert (module docstring); `gather`: w is its at-rest shard, cast there and
    all-gathered in f8 with its scales."""
    w, axes = shared_weight(x, w, gather)
    return _grouped(jnp.dtype(precision.step_reduce_dtype() or w.dtype), axes, gather)(x, w, sizes)


def batched_matmul(x, w, gather: Gather = ()):
    """x (E, C, K), w (E, K, N) -> (E, C, N) in x's dtype, rowwise FP8 per expert; `gather` as
    `grouped_matmul`'s."""
    w, axes = shared_weight(x, w, gather)
    return _batched(jnp.dtype(precision.step_reduce_dtype() or w.dtype), axes, gather)(x, w)
