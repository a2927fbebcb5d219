"""Routed experts' GEMMs as scaled FP8 matmuls, one scale per expert (docs/fp8.md).

Two layouts, as the MoE layer computes its experts:
- grouped: rows `x` (M, K) sorted by expert, `w` (E, K, N), `sizes` (E,) rows per expert
  (`jax.lax.ragged_dot`; rows past sum(sizes) belong to no expert and come out 0);
- batched: `x` (E, C, K) a buffer of C rows per expert, `w` (E, K, N).

Each expert's GEMM is scaled as a dense projection is (`fsdp_jax.quant.fp8`), with its own
scales, as Transformer Engine's `GroupedLinear` gives each of its GEMMs its own quantizer for
the input, the weight and the output gradient:

    sx_e = 448 / amax(x rows of e),  sw_e = 448 / amax(w[e])     (e4m3, current amax)
    y_r  = (dot(e4m3(x_r sx_e), e4m3(w[e] sw_e)) in f32, written in x's dtype) * (1 / (sx_e sw_e))
    sg_e = 57344 / amax(g rows of e)                              (e5m2)
    dx_r = dot(gq_r, wq[e]^T) * (1 / (sg_e sw_e)),   dw[e] = sum_{r in e} xq_r^T gq_r * (1 / (sx_e sg_e))

(r a row of expert e, f32 accumulation). The scales are the current amaxes, or, under the
delayed recipe, each expert's own histories (`hist` (E, 3, L) float32: rows input, weight,
output gradient, newest first): a scale from the history's max (the current amax while it is
all zeros, as `fp8.history_scale`). All three histories leave through the backward pass: the
cotangent of `hist` is each history with this call's amax pushed, which the train step keeps
as the new value (a `*_from_grad` model-state leaf, `fsdp_jax.model.variables`), since the
gradient's amax exists only there and the MoE layer's `shard_map` returns only its output.
Inside the MoE layer's
`shard_map` a device holds some of an expert's rows: the amaxes are maxed over the mesh axes
the rows vary over and the weight does not (the batch axes that do not hold experts), so
every layout scales by the amax of all of an expert's rows, as one device does.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import jax
import jax.numpy as jnp

from fsdp_jax.quant import fp8_expert_gather
from fsdp_jax.quant.fp8 import E4M3, E5M2, quantize, scale_for
from fsdp_jax.quant.fp8_expert_gather import Gather
from fsdp_jax.sharding import precision

# x (M, K), g (M, N) -> dw (E, K, N): contracted over the rows, one sum per expert
DW_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=()
)


def varying_axes(a) -> set[str]:
    """The manual mesh axes (inside a `shard_map`) over which `a`'s value varies."""
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)  # jax 0.10; earlier releases: `vma`
    return set(mat.varying if mat is not None else getattr(t, "vma", ()))


def group_ids(sizes, n_rows: int) -> jax.Array:
    """(n_rows,) int32: each row's expert for rows grouped by `sizes` (E,); E past the groups."""
    return jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(n_rows), side="right").astype(jnp.int32)


def _grouped_amax(x, gid, n_groups: int) -> jax.Array:
    """(E,) float32: max |x| over each expert's rows (0 for an expert without rows)."""
    rowmax = jnp.max(jnp.abs(x.astype(jnp.float32)), axis=-1)
    return jnp.maximum(jax.ops.segment_max(rowmax, gid, num_segments=n_groups + 1)[:n_groups], 0.0)


def _per_row(v, gid) -> jax.Array:
    """Per-expert (E,) float32 values as a (M, 1) column for rows of experts `gid` (1 past the groups)."""
    return jnp.concatenate([v, jnp.ones((1,), v.dtype)])[gid][:, None]


def pmax_over(a, axes: tuple[str, ...]):
    return jax.lax.pmax(a, axes) if axes else a


def _scales(h, current, dtype) -> jax.Array:
    """(E,) scales from per-expert histories `h` (E, L), or `current` (E,) where None or all zeros."""
    if h is None:
        return scale_for(current, dtype)
    ref = jnp.max(h, axis=-1)
    return scale_for(jnp.where(ref > 0, ref, current), dtype)


def _pushed(h, ax, aw, ag) -> jax.Array:
    """`h` (E, 3, L) with the amaxes (E,) of input, weight and gradient pushed in front."""
    now = jnp.stack([ax, aw, ag], axis=1).astype(h.dtype)  # (E, 3)
    return jnp.concatenate([now[..., None], h[..., :-1]], axis=-1)


def finish_dw(dw, reduce_dtype, w_dtype, gather: Gather = (), axes: tuple[str, ...] = ()):
    """The weight gradient in `w_dtype`; with a `gather` (the weight came in as its at-rest
    shard), reduced and scattered back to that shard in `reduce_dtype` (`fp8_expert_gather`)."""
    if gather:
        return fp8_expert_gather.reduce_scatter(dw, gather, axes, reduce_dtype, w_dtype)
    if reduce_dtype.itemsize > jnp.dtype(w_dtype).itemsize:  # reduced across devices in the wider dtype
        dw = jax.lax.optimization_barrier(dw.astype(reduce_dtype))
    return dw.astype(w_dtype)


def _weight(w, hist_w, axes, gather: Gather):
    """(scales (E,), the weight's amaxes (E,), its e4m3 cast as the matmul takes it, that cast as
    the residual keeps it): the cast runs on what `w` is here (with a `gather`, the at-rest shard,
    its amaxes maxed across the gather axes) and the f8 is all-gathered; the residual keeps the
    f8 shard, gathered again in the backward pass (ZeRO-3)."""
    aw = jnp.max(jnp.abs(w.astype(jnp.float32)), axis=(1, 2))
    aw = pmax_over(aw, fp8_expert_gather.gather_axes(gather) if gather else axes)  # equal on every device
    sw = _scales(hist_w, aw, E4M3)
    wq = quantize(w, sw[:, None, None], E4M3)
    return sw, aw, fp8_expert_gather.all_gather(wq, gather), wq


@functools.lru_cache(maxsize=None)
def _grouped(reduce_dtype, axes: tuple[str, ...], delayed: bool, gather: Gather):
    @jax.custom_vjp
    def f(x, w, sizes, hist):
        return fwd(x, w, sizes, hist)[0]

    def fwd(x, w, sizes, hist):
        gid, n = group_ids(sizes, x.shape[0]), w.shape[0]
        ax = pmax_over(_grouped_amax(x, gid, n), axes)
        sx = _scales(hist[:, 0] if delayed else None, ax, E4M3)
        sw, aw, wq, kept = _weight(w, hist[:, 1] if delayed else None, axes, gather)
        rx, rw = _per_row(sx, gid), _per_row(sw, gid)
        xq = quantize(x, rx, E4M3)
        y = jax.lax.ragged_dot(xq, wq, sizes, preferred_element_type=x.dtype) * (1.0 / (rx * rw))
        res = (xq, kept, sizes, sx, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype), hist, ax, aw)
        return y.astype(x.dtype), res

    def bwd(res, g):
        xq, wq, sizes, sx, sw, x_like, w_like, hist, ax, aw = res
        wq = fp8_expert_gather.all_gather(wq, gather)
        gid, n = group_ids(sizes, g.shape[0]), wq.shape[0]
        ag = pmax_over(_grouped_amax(g, gid, n), axes)
        sg = _scales(hist[:, 2] if delayed else None, ag, E5M2)
        rg = _per_row(sg, gid)
        gq = quantize(g, rg, E5M2)
        dx = jax.lax.ragged_dot(gq, jnp.swapaxes(wq, 1, 2), sizes, preferred_element_type=jnp.float32)
        dx = (dx * (1.0 / (rg * _per_row(sw, gid)))).astype(x_like.dtype)
        dw = jax.lax.ragged_dot_general(xq, gq, sizes, DW_DIMS, preferred_element_type=jnp.float32)
        dw = dw * (1.0 / (sx * sg))[:, None, None]
        new = _pushed(hist, ax, aw, ag) if delayed else jnp.zeros_like(hist)
        return dx, finish_dw(dw, reduce_dtype, w_like.dtype, gather, axes), None, new

    f.defvjp(fwd, bwd)
    return f


def _dot(a, b, contract, out=jnp.float32):
    """dot_general over dim 0 of both (the expert), contracting `contract`, in `out`."""
    return jax.lax.dot_general(a, b, (contract, ((0,), (0,))), preferred_element_type=out)


@functools.lru_cache(maxsize=None)
def _batched(reduce_dtype, axes: tuple[str, ...], delayed: bool, gather: Gather):
    @jax.custom_vjp
    def f(x, w, hist):
        return fwd(x, w, hist)[0]

    def fwd(x, w, hist):
        ax = pmax_over(jnp.max(jnp.abs(x.astype(jnp.float32)), axis=(1, 2)), axes)
        sx = _scales(hist[:, 0] if delayed else None, ax, E4M3)
        sw, aw, wq, kept = _weight(w, hist[:, 1] if delayed else None, axes, gather)
        xq = quantize(x, sx[:, None, None], E4M3)
        y = _dot(xq, wq, ((2,), (1,)), x.dtype) * (1.0 / (sx * sw))[:, None, None]
        res = (xq, kept, sx, sw, jnp.zeros((0,), x.dtype), jnp.zeros((0,), w.dtype), hist, ax, aw)
        return y.astype(x.dtype), res

    def bwd(res, g):
        xq, wq, sx, sw, x_like, w_like, hist, ax, aw = res
        wq = fp8_expert_gather.all_gather(wq, gather)
        ag = pmax_over(jnp.max(jnp.abs(g.astype(jnp.float32)), axis=(1, 2)), axes)
        sg = _scales(hist[:, 2] if delayed else None, ag, E5M2)
        gq = quantize(g, sg[:, None, None], E5M2)
        dx = (_dot(gq, wq, ((2,), (2,))) * (1.0 / (sg * sw))[:, None, None]).astype(x_like.dtype)
        dw = _dot(xq, gq, ((1,), (1,))) * (1.0 / (sx * sg))[:, None, None]
        new = _pushed(hist, ax, aw, ag) if delayed else jnp.zeros_like(hist)
        return dx, finish_dw(dw, reduce_dtype, w_like.dtype, gather, axes), new

    f.defvjp(fwd, bwd)
    return f


def shared_weight(x, w, gather: Gather = ()):
    """(w marked varying over the mesh axes x varies over and w does not; those axes sorted):
    the amaxes are maxed over those axes, and w's gradient, computed per device, is summed
    over them by the transpose of the mark. With a `gather` (w is its at-rest shard) the axes
    are those x varies over and the gathered weight does not, and w is left as it is: the
    custom VJP sums and scatters its gradient (`fp8_expert_gather.reduce_scatter`)."""
    if gather:
        whole = varying_axes(w) - set(fp8_expert_gather.gather_axes(gather))
        return w, tuple(sorted(varying_axes(x) - whole))
    extra = tuple(sorted(varying_axes(x) - varying_axes(w)))
    return (jax.lax.pcast(w, extra, to="varying") if extra else w), extra


class ExpertWeight(NamedTuple):
    """An expert weight (E, K, N) as one `dot` operand, with its delayed histories (E, 3, L)
    or None, and its FP8 gather (`fp8_expert_gather.Gather`; () : `w` is whole)."""

    w: jax.Array
    hist: jax.Array | None = None
    gather: Gather = ()


def unpack(m) -> ExpertWeight:
    """A `dot` operand (a weight or an `ExpertWeight`) as an `ExpertWeight`."""
    return m if isinstance(m, ExpertWeight) else ExpertWeight(m)


def _hist(w, hist):
    """(the history operand, delayed?): `hist` (E, 3, L) float32, or an empty (E, 3, 0) one."""
    if hist is None:
        return jnp.zeros((w.shape[0], 3, 0), jnp.float32), False
    return jnp.asarray(hist, jnp.float32), True


def grouped_matmul(x, w, sizes, hist=None, gather: Gather = ()):
    """x (M, K) rows sorted by expert, w (E, K, N), sizes (E,) int32 -> (M, N) in x's dtype,
    each expert's rows through FP8 with that expert's scales (module docstring); `hist` (E, 3,
    L) the delayed recipe's per-expert histories (its cotangent: the new histories), or None;
    `gather`: w is its at-rest shard, cast there and all-gathered in f8 (`fp8_expert_gather`)."""
    w, axes = shared_weight(x, w, gather)
    h, delayed = _hist(w, hist)
    rd = jnp.dtype(precision.step_reduce_dtype() or w.dtype)
    return _grouped(rd, axes, delayed, gather)(x, w, sizes, h)


def batched_matmul(x, w, hist=None, gather: Gather = ()):
    """x (E, C, K), w (E, K, N) -> (E, C, N) in x's dtype, per expert through FP8; `hist` and
    `gather` as `grouped_matmul`'s."""
    w, axes = shared_weight(x, w, gather)
    h, delayed = _hist(w, hist)
    return _batched(jnp.dtype(precision.step_reduce_dtype() or w.dtype), axes, delayed, gather)(x, w, h)
