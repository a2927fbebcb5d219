"""Explicit per-layer parameter gathers: where a model casts and gathers its params.

A model that scans its layers calls `gather_module(block)` (Flax NNX) or
`gather(values, names)` at the top of each layer's function, inside its remat
region, and `block_policy(remat_name)` for that region's policy. Outside a train step
both are the identity and the plain policy. Inside `make_train_step` (which makes a
`LayerGather` current while the loss is traced) each floating param leaf of the layer
is, in the forward pass, cast to the compute dtype in its at-rest (sharded) layout and
gathered to its compute layout; in the backward pass its cotangent is cast to the
reduce dtype *while still in the gathered layout* and constrained back to the at-rest
layout, so the cross-device reduction is a per-layer reduce-scatter (all-reduce when
params are replicated) in the reduce dtype.

Whether the gathered copy lives from forward to backward is the strategy's choice,
made through the remat policy (`block_policy`) and the checkpoint name `GATHERED`:
- `keep=False` (ZeRO-3, `full_shard` / `hybrid_shard`): never saved; the backward
  re-gathers each layer.
- `keep=True` (ZeRO-2, `shard_grad_op`): saved, so the backward uses the forward's
  copy (no second gather) and still reduce-scatters each layer's grads. This is how
  ZeRO-2 is defined (params unsharded from forward to backward, grads sharded); a
  gather of the whole tree before the layer loop instead makes XLA:GPU all-reduce
  full-size grads inside the backward loop.

This module knows no model: values and logical names come from the caller.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import Mesh, NamedSharding

from fsdp_jax.sharding import precision
from fsdp_jax.sharding.mesh import constrain
from fsdp_jax.sharding.remat import get_policy
from fsdp_jax.sharding.rules import plan_leaf
from fsdp_jax.sharding.thresholds import DEFAULT_MIN_SHARD_SIZE

GATHERED = "fsdp_gathered_params"  # checkpoint name of a layer's gathered params
FETCHED = "fsdp_fetched_params"  # ... of a layer's host-resident params brought to the device (never saved)
cp = jax.checkpoint_policies


@dataclasses.dataclass(frozen=True)
class LayerGather:
    """What `gather` does while a train step is traced: shard params over `shard_axes`
    of `mesh` by `rules` at rest, compute in `compute_dtype`, reduce grads in
    `reduce_dtype`, and `keep` the gathered copy for the backward pass (ZeRO-2)."""

    mesh: Mesh
    rules: Any
    shard_axes: tuple[str, ...]
    compute_dtype: Any
    reduce_dtype: Any
    keep: bool = False
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE
    probe: bool = False  # only record that the model gathers (no casts, no layouts)
    # a streamed offload of params: host-resident leaves come to the device here, one
    # layer at a time (forward, and again in the backward where the layer is recomputed)
    fetch: bool = False
    # cast and gather explicitly (ZeRO-2); False: cast in the at-rest layout only and
    # leave the gather to XLA (ZeRO-3 and the strategies that keep params whole)
    explicit: bool = True


_CURRENT: list[LayerGather] = []
_CALLED: list[int] = [0]
_PER_USE: list[LayerGather | None] = []  # ZeRO-3: where params rest, gathered by XLA where used


def current() -> LayerGather | None:
    return _CURRENT[-1] if _CURRENT else None


@contextlib.contextmanager
def active(lg: LayerGather | None):
    """Make `lg` current while a loss is traced (None: gathers stay the identity)."""
    _CURRENT.append(lg)
    try:
        yield
    finally:
        _CURRENT.pop()


@contextlib.contextmanager
def gathered_per_use(lg: LayerGather | None):
    """While a loss is traced under a strategy whose params rest sharded and are gathered
    where they are used (full_shard, hybrid_shard: XLA's gathers, `explicit=False`): `lg`
    describes that layout, for `per_use_layouts`. None: params are whole in compute."""
    _PER_USE.append(lg)
    try:
        yield
    finally:
        _PER_USE.pop()


def per_use_layouts(shape, dtype, names) -> tuple[NamedSharding, NamedSharding] | None:
    """(at rest, gathered) layouts of a param of `shape` and logical `names` (stack dims
    already sliced off: the trailing names are used) under the strategy `gathered_per_use`
    made current, so a caller can transform a weight on its shards before XLA gathers it
    (FP8 weight gathers, `fsdp_jax.quant.fp8`); None when no such strategy is current,
    without names, or when the two layouts agree."""
    lg = _PER_USE[-1] if _PER_USE else None
    if lg is None or names is None:
        return None
    names = tuple(names)[len(names) - len(shape) :]
    x = jax.ShapeDtypeStruct(tuple(shape), dtype)
    rest, full = _spec(x, names, lg, lg.shard_axes), _spec(x, names, lg, ())
    return None if rest.spec == full.spec else (rest, full)


def model_gathers(loss_fn, params, batch, lg: LayerGather) -> bool:
    """Does `loss_fn(params, batch)` call `gather` (traced abstractly, nothing computed)?"""
    before = _CALLED[0]
    with active(dataclasses.replace(lg, probe=True)):
        # a fresh function each time: eval_shape caches traces per function, and a cached
        # trace would not call `gather` again
        jax.eval_shape(lambda p, b: loss_fn(p, b), params, batch)
    return _CALLED[0] > before


def block_policy(remat: str):
    """The remat policy for a layer region that calls `gather`: `remat`'s policy, plus
    saving the gathered params under ZeRO-2, or (no remat) minus recomputing them
    under ZeRO-3. None: no remat region is needed."""
    base = get_policy(remat)
    lg = current()
    if lg is None or lg.probe:
        return base
    if lg.keep:
        return None if base is None else cp.save_from_both_policies(base, cp.save_only_these_names(GATHERED))
    if base is None:
        return _refetch_policy if lg.fetch else cp.save_anything_except_these_names(GATHERED)
    return base


_CASTS = ("cast_gather", "cast_for_compute")  # the custom_vjp casts of `gather` (their jaxpr names)
# layout ops, free to recompute and no smaller than their input: saving one of a fetched weight
# (the attention's (d, heads, head_dim) -> (d, heads * head_dim) reshape) would keep a device
# copy of that weight for every layer; not saving one of an activation keeps its input instead
_RELAYOUTS = ("reshape", "transpose", "broadcast_in_dim", "squeeze", "expand_dims")


def _refetch_policy(prim, *_, **params) -> bool:
    """Save anything but a layer's fetched params: neither the device copy of its
    host-resident params (`device_put`) nor their cast (the custom_vjp casts named in
    `_CASTS`) nor what is named GATHERED / FETCHED. Naming the cast's output alone
    would save its input, the cast copy: only the host-resident slice, an input of the
    layer's function, remains, and the backward fetches the layer again. Nor a layout op
    (`_RELAYOUTS`): it may be of a fetched weight."""
    if prim.name == "name":
        return params.get("name") not in (GATHERED, FETCHED)
    if prim.name == "device_put" or prim.name in _RELAYOUTS:
        return False
    return not (prim.name == "custom_vjp_call" and _function_name(params) in _CASTS)


def _function_name(params) -> str:
    """The Python name of a custom_vjp_call's function: its `name` param where it has one,
    else the name its traced jaxpr's debug info starts with ("cast_gather at file:line"; jax
    0.10 and 0.12 carry no `name`)."""
    if params.get("name"):
        return params["name"]
    jaxpr = params.get("call_jaxpr")
    info = getattr(getattr(jaxpr, "jaxpr", jaxpr), "debug_info", None)
    return (getattr(info, "func_src_info", None) or "").split(" ")[0]


def gather(values, names):
    """`values` (a tree of a layer's params) cast to the compute dtype and laid out for
    compute; `names` a matching tree of logical-name tuples (None: unannotated).
    The identity outside a train step."""
    lg = current()
    if lg is None:
        return values
    _CALLED[0] += 1
    if lg.probe:
        return values
    flat, treedef = jax.tree.flatten(values)
    flat_names = treedef.flatten_up_to(names)
    return jax.tree.unflatten(treedef, [_leaf(x, n, lg) for x, n in zip(flat, flat_names)])


def gather_module(module):
    """`gather` over a Flax NNX module's `nnx.Param`s (names from their partitioning
    metadata); returns a module to call in its place."""

    if current() is None:
        return module
    graphdef, state, rest = nnx.split(module, nnx.Param, ...)
    pure = nnx.to_pure_dict(state)
    names: dict = {}
    for path, v in nnx.to_flat_state(state):
        node = names
        for k in path[:-1]:
            node = node.setdefault(k, {})
        node[path[-1]] = _logical_names(v)
    new = gather(pure, names)
    nnx.replace_by_pure_dict(state, new)
    return nnx.merge(graphdef, state, rest)


def _logical_names(v) -> tuple | None:
    """A Variable's logical names as written (`nnx.get_partition_spec` maps them through
    the current rules, i.e. to mesh axes, inside a train step)."""
    md = v.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if md.get(key) is not None:
            return tuple(md[key])
    return None


def on_host(x) -> bool:
    """Is `x` (inside jit) in host memory (a host-resident leaf or a slice of one)?"""
    return getattr(jax.typeof(x), "memory_space", None) == jax.memory.Space.Host


def _leaf(x, names, lg: LayerGather):
    if lg.fetch and on_host(x):
        # same sharding, device memory; its transpose moves the layer's grads to the
        # host, which the step brings back once the backward pass is done
        x = checkpoint_name(jax.device_put(x, jax.memory.Space.Device), FETCHED)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        # integer leaves (a quantised frozen weight's codes and scales, `fsdp_jax.quant`): no
        # cast, no gradient; gathered here, so what moves is the codes, not the dequantised weight
        return checkpoint_name(constrain(x, _spec(x, names, lg, ())), GATHERED)
    rest = _spec(x, names, lg, lg.shard_axes)
    compute, reduce = jnp.dtype(lg.compute_dtype), jnp.dtype(lg.reduce_dtype)
    if lg.explicit:
        y = _make(rest, _spec(x, names, lg, ()), compute, reduce)(x)
    else:  # the cast of `cast_params_for_compute`, one layer at a time
        y = precision.cast_leaf(x, rest, compute, reduce)
    return checkpoint_name(y, GATHERED)


def _spec(x, names, lg: LayerGather, shard_axes) -> NamedSharding:
    row, _ = plan_leaf("", x.shape, x.dtype, names, lg.mesh, lg.rules, shard_axes, lg.min_shard_size)
    return NamedSharding(lg.mesh, row.spec)


@functools.lru_cache(maxsize=None)
def _make(rest, full, compute_dtype, reduce_dtype):
    @jax.custom_vjp
    def cast_gather(x):
        return constrain(constrain(x, rest).astype(compute_dtype), full)

    def fwd(x):
        return cast_gather(x), jnp.zeros((), x.dtype)  # residual carries only the dtype

    def bwd(res, g):
        # g is a partial sum over the batch shards; constraining it to the at-rest layout
        # makes the partitioner reduce-scatter it at the dot that produced it, in that
        # dot's (compute) dtype. Measured on XLA:GPU (jax 0.10.2): a cast to the reduce
        # dtype before this constraint turns the scatter into a full-size all-reduce in
        # the compute dtype, and constraining the cast to `full` does too; so the cast
        # to the reduce dtype follows the scatter, as on XLA's own path (full_shard).
        return (constrain(g, rest).astype(reduce_dtype).astype(res.dtype),)

    cast_gather.defvjp(fwd, bwd)
    return cast_gather
