"""FP8 weight gathers for routed experts: under full_shard / hybrid_shard an expert weight
enters the MoE layer's `shard_map` as its at-rest shard, is cast to e4m3 there with a scale per
expert (the shards' amaxes maxed across the gather axes), and its f8 shards are all-gathered;
the backward pass returns the weight gradient to the shard as a reduce-scatter in the reduce
dtype, never in f8 (docs/fp8.md "FP8 weight gathers").

This is torchao's Float8 FSDP all-gather (`WeightWithDynamicFloat8CastTensor.fsdp_pre_all_gather`:
the local shard cast with `reduce_amax=True`, f8 data all-gathered with its scale as metadata;
`fsdp_post_all_gather` wraps it as a tensor whose autograd dtype stays the param's, so FSDP2
reduce-scatters a high-precision gradient), torchtitan's `enable_fsdp_float8_all_gather`, per
expert. In JAX a cast's cotangent has the cast's dtype, so a straight-through f8 cast before a
gather would bring the gradient back in f8: instead one custom VJP (`fp8_experts`' grouped and
batched products) takes the shard, casts and gathers it in its forward pass, and reduces and
scatters the full-precision weight gradient in its backward pass, inside the `shard_map`.

A gather is described per weight as `((dim, mesh axes), ...)`: the dims the at-rest layout
shards and the compute layout does not, and over which axes (`gather_dims`).
"""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from fsdp_jax.train import layer_gather

Gather = tuple[tuple[int, tuple[str, ...]], ...]


def _axes(entry) -> tuple[str, ...]:
    return () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))


def gather_dims(rest: P, full: P, ndim: int) -> Gather | None:
    """What turns the at-rest layout `rest` into the compute layout `full` of a weight of `ndim`
    dims, as all-gathers: ((dim, axes), ...). None when that is not a plain gather of an
    expert weight: the expert dim (0) gathered, another dim left sharded in compute, or a dim
    sharded differently."""
    out = []
    for d in range(ndim):
        r, f = _axes(rest[d] if d < len(rest) else None), _axes(full[d] if d < len(full) else None)
        if (d == 0 and r != f) or (d > 0 and f):  # the expert dim keeps its split; the others whole
            return None
        if r != f:
            out.append((d, r))
    return tuple(out)


def gather_axes(gather: Gather) -> tuple[str, ...]:
    return tuple(a for _, axes in gather for a in axes)


def all_gather(a, gather: Gather):
    """`a` (a shard, inside a `shard_map`) all-gathered along each dim of `gather`."""
    for dim, axes in gather:
        a = jax.lax.all_gather(a, axes, axis=dim, tiled=True)
    return a


def reduce_scatter(dw, gather: Gather, axes: tuple[str, ...], reduce_dtype, dtype):
    """A weight gradient `dw` (whole, this device's part of the sum over `axes`, the mesh axes
    its rows vary over and the weight's shard does not) summed over `axes` in `reduce_dtype`:
    scattered over the gather axes back to the shard's layout, summed over the others; in `dtype`."""
    dw = dw.astype(reduce_dtype)
    summed = tuple(a for a in axes if a not in gather_axes(gather))
    if summed:
        dw = jax.lax.psum(dw, summed)
    for dim, ax in gather:
        dw = jax.lax.psum_scatter(dw, ax, scatter_dimension=dim, tiled=True)
    return dw.astype(dtype)


def _logical_names(v) -> tuple | None:
    if not isinstance(v, nnx.Variable):
        return None
    md = v.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if md.get(key) is not None:
            return tuple(md[key])
    return None


def expert_gathers(module, names: tuple[str, ...], values) -> tuple[tuple[P, Gather], ...] | None:
    """For the expert weights `names` of `module` (their values `values`, in that order): each
    one's (at-rest spec, `Gather`) under the strategy `layer_gather.gathered_per_use` made
    current (full_shard, hybrid_shard); None where any of them has no plain f8 gather (another
    strategy, unannotated, a layout `gather_dims` refuses)."""
    out = []
    for name, w in zip(names, values):
        lay = layer_gather.per_use_layouts(w.shape, w.dtype, _logical_names(getattr(module, name, None)))
        gather = None if lay is None else gather_dims(lay[0].spec, lay[1].spec, w.ndim)
        if not gather:
            return None
        out.append((lay[0].spec, gather))
    return tuple(out)
