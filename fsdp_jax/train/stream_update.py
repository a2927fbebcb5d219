"""The optimizer update of host-offloaded state, streamed layer by layer.

A scanned model stacks each weight of all its layers in one leaf (dim 0 = layers), so
`offload.fetch` of a whole leaf brings every layer's master weights and optimizer state
to the device at once (70B: 80 layers of an MLP weight, several GB per device). Here the
update is split in two, with the same optax call and the same elementwise arithmetic:

1. the leaves that are not stacked (embeddings, final norm, head) are fetched, updated
   and stored as before, in one call of `optimizer.update` over the whole tree in which
   every stacked leaf is an empty slice (`x[:0]`: same rank, no elements); the step
   counters of the optimizer state come from this call;
2. a `lax.fori_loop` over the layers updates the stacked leaves: iteration `i` slices
   layer `i` out of the host-resident params and optimizer state
   (`dynamic_slice_in_dim(x, i, 1)`, rank kept), moves it to the device, runs the same
   `optimizer.update` (the other leaves empty), skips non-finite steps with the same
   per-leaf select as `guarded_update`, moves the new slice back to host memory and
   writes it in place (`dynamic_update_slice`, the donated at-rest buffer).

So the device holds one layer's offloaded state per iteration; when XLA overlaps
iteration i+1's host-to-device copy with iteration i's update (async transfers inside the
loop, as the TPU target schedules them), two. On an XLA:TPU compile of an 8-layer model the
device peak is 6.4 layers' worth below the whole-leaf update's (tests/test_stream_update.py). The update runs on the device
(a fused elementwise pass); running it on the host (`compute_on("device_host")`) would move
no fewer bytes over PCIe per step (the grads would travel instead) and needs a host
compute path per backend, so the device update was kept.

This is exact only for an optimizer whose update is elementwise over each param leaf
(SGD, momentum, Adam, AdamW, Lion with schedules on the step count); one that reduces over
a leaf (global-norm clipping inside the chain, LAMB's trust ratio, Adafactor's factored
moments) would see a layer instead of the leaf. `elementwise_reason` reads the update's
jaxpr and says why not; a streamed offload with such an optimizer is refused (OffloadError).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax

from fsdp_jax.errors import OffloadError
from fsdp_jax.sharding import offload
from fsdp_jax.sharding.strategy import ShardingPlan
from fsdp_jax.train.state import TrainState

# primitives that act on each element alone (or on scalars: the step count, its schedule)
ELEMENTWISE = frozenset(
    """abs add and atan2 ceil clamp convert_element_type copy copy_p cos cosh div eq erf exp exp2
    expm1 floor ge gt integer_pow is_finite le log log1p logistic lt max min mul ne neg nextafter
    not or pow rem round rsqrt select_n sign sin sinh sqrt square stop_gradient sub tan tanh xor""".split()
)
CALLS = frozenset({"jit", "pjit", "closed_call", "custom_jvp_call", "custom_vjp_call", "remat", "checkpoint"})

LAYERED, FLAT, OTHER = "layered", "flat", "other"


def _sub_jaxprs(params):
    for v in params.values():
        for sub in v if isinstance(v, (list, tuple)) else (v,):
            if hasattr(sub, "eqns"):
                yield sub
            elif hasattr(getattr(sub, "jaxpr", None), "eqns"):
                yield sub.jaxpr


def _first_not_elementwise(jaxpr) -> str | None:
    for e in jaxpr.eqns:
        name = e.primitive.name
        if name in CALLS:
            for sub in _sub_jaxprs(e.params):
                bad = _first_not_elementwise(sub)
                if bad:
                    return bad
        elif name == "broadcast_in_dim":
            if any(getattr(v.aval, "size", 1) > 1 for v in e.invars):
                return "broadcast_in_dim of a non-scalar"
        elif name not in ELEMENTWISE and any(getattr(v.aval, "size", 1) > 1 for v in e.invars):
            return name
    return None


def elementwise_reason(optimizer: optax.GradientTransformation, abstract_params, abstract_opt_state) -> str | None:
    """None when `optimizer.update` acts on every param element alone (so a layer's slice
    updates exactly as it would inside its leaf); else the first primitive that does not
    (e.g. `reduce_sum` of `clip_by_global_norm`)."""
    params = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_params)
    state = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), abstract_opt_state)
    jaxpr = jax.make_jaxpr(optimizer.update)(params, state, params)
    bad = _first_not_elementwise(jaxpr.jaxpr)
    return None if bad is None else f"optimizer update uses {bad!r} over a whole leaf"


def streams(plan: ShardingPlan) -> bool:
    """Whether `plan`'s offload streams (`optimizer:streamed`, `optimizer+params:streamed`)
    and it has leaves stacked over layers."""
    return offload.get_offload(plan.offload).stream and plan.layered is not None and any(jax.tree.leaves(plan.layered))


def streamable(plan: ShardingPlan, optimizer: optax.GradientTransformation, state: TrainState) -> bool:
    """Whether the step streams the update: `streams(plan)`. Raises OffloadError (one line)
    when the plan asks for a streamed offload but the optimizer's update is not elementwise
    over `state`'s leaves (a layer's slice would not update as its leaf does)."""
    if not streams(plan):
        return False
    reason = elementwise_reason(optimizer, state.params, state.opt_state)
    if reason is not None:
        raise OffloadError(
            f"offload: {plan.offload!r} updates one layer at a time, but the {reason}; "
            f"use offload: {plan.offload.removesuffix(':streamed')}"
        )
    return True


def _labels(optimizer, opt_state, layered):
    """Per optimizer-state leaf: LAYERED / FLAT (param-shaped, like its param) or OTHER."""
    return optax.tree_utils.tree_map_params(
        optimizer,
        lambda _, lay: LAYERED if lay else FLAT,
        opt_state,
        layered,
        transform_non_params=lambda _: OTHER,
    )


def _empty(x):
    return x[:0] if x.ndim else x  # same rank, no elements (a scalar stays: it is tiny)


def _layer(x, i):
    return jax.lax.dynamic_slice_in_dim(x, i, 1, 0)


def _dev(x, s):
    return jax.device_put(x, s.with_memory_kind(offload.DEVICE)) if offload.is_host(s) else x


def _rest(x, s):
    return jax.device_put(x, s) if offload.is_host(s) else x


def _sharding_leaf(x) -> bool:
    return isinstance(x, jax.sharding.Sharding)


def _update(optimizer, grads, opt_state, params, ok, skip_nonfinite):
    updates, new_state = optimizer.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    if skip_nonfinite:
        new_params = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_params, params)
        new_state = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_state, opt_state)
    return new_params, new_state


@jax.named_scope("optimizer")
def streamed_update(
    optimizer: optax.GradientTransformation,
    state: TrainState,
    grads,
    ok,
    plan: ShardingPlan,
    skip_nonfinite: bool = True,
) -> TrainState:
    """`guarded_update` of a `state` at rest (offloaded leaves in host memory, as the step
    receives them), with the stacked leaves (`plan.layered`) updated one layer at a time;
    the returned state is at rest again. For an elementwise optimizer (`elementwise_reason`
    is None) it computes what `guarded_update` of the fetched state does, element by element:
    bit for bit on XLA:CPU's default emitters (tests/test_stream_update.py; its legacy loop
    emitters contract FMAs by fusion boundary and differ in the last place, docs/offload.md)."""
    lay, psh, osh = plan.layered, plan.params, plan.opt_state
    labels = _labels(optimizer, state.opt_state, lay)
    n_layers = next(x.shape[0] for x, m in zip(jax.tree.leaves(state.params), jax.tree.leaves(lay)) if m)

    def cut(tree, marks, keep, fn):  # leaves marked `keep` through fn, OTHER as they are, the rest empty
        return jax.tree.map(lambda x, m: fn(x) if m == keep else x if m == OTHER else _empty(x), tree, marks)

    pmarks = jax.tree.map(lambda m: LAYERED if m else FLAT, lay)

    # 1. the leaves not stacked over layers, and the optimizer's counters
    p_f, s_f = cut(state.params, pmarks, FLAT, lambda x: x), cut(state.opt_state, labels, FLAT, lambda x: x)
    p_f, s_f = _dev_tree(p_f, psh), _dev_tree(s_f, osh)
    g_f = cut(grads, pmarks, FLAT, lambda x: x)
    new_pf, new_sf = _update(optimizer, g_f, s_f, p_f, ok, skip_nonfinite)

    # 2. the stacked leaves, one layer per iteration, written back in place
    def body(i, carry):
        params, opt_state = carry
        p_i = _dev_tree(cut(params, pmarks, LAYERED, lambda x: _layer(x, i)), psh)
        s_i = _dev_tree(cut(opt_state, labels, LAYERED, lambda x: _layer(x, i)), osh)
        g_i = cut(grads, pmarks, LAYERED, lambda x: _layer(x, i))
        new_pi, new_si = _update(optimizer, g_i, s_i, p_i, ok, skip_nonfinite)

        def put(old, new, s, m):
            if m != LAYERED:
                return old
            return jax.lax.dynamic_update_slice_in_dim(old, _rest(new, s), i, 0)

        params = jax.tree.map(put, params, new_pi, psh, pmarks, is_leaf=_sharding_leaf)
        opt_state = jax.tree.map(put, opt_state, new_si, osh, labels, is_leaf=_sharding_leaf)
        return params, opt_state

    params, opt_state = jax.lax.fori_loop(0, n_layers, body, (state.params, state.opt_state))

    def take(layered_out, flat_out, s, m):
        return layered_out if m == LAYERED else _rest(flat_out, s)

    params = jax.tree.map(take, params, new_pf, psh, pmarks, is_leaf=_sharding_leaf)
    opt_state = jax.tree.map(take, opt_state, new_sf, osh, labels, is_leaf=_sharding_leaf)
    step = state.step + 1 if not skip_nonfinite else jnp.where(ok, state.step + 1, state.step)
    return state.replace(step=step, params=params, opt_state=opt_state)


def _dev_tree(tree, shardings):
    return jax.tree.map(lambda s, x: _dev(x, s), shardings, tree, is_leaf=_sharding_leaf)


def per_layer_bytes(optimizer: optax.GradientTransformation, abstract_state: TrainState, plan: ShardingPlan) -> int:
    """Per-device bytes of one layer's offloaded state (the stacked leaves' shards over the
    layer count): what one iteration of the streamed update brings to the device."""
    o = offload.get_offload(plan.offload)
    labels = _labels(optimizer, abstract_state.opt_state, plan.layered)
    pairs = []
    if o.params:
        pairs += [
            (x, LAYERED if m else FLAT)
            for x, m in zip(jax.tree.leaves(abstract_state.params), jax.tree.leaves(plan.layered))
        ]
    if o.opt_state:
        pairs += list(zip(jax.tree.leaves(abstract_state.opt_state), jax.tree.leaves(labels)))
    total = 0
    for x, m in pairs:
        if m == LAYERED:
            shape = x.sharding.shard_shape(x.shape)
            total += int(np.prod(shape[1:], dtype=np.int64)) * np.dtype(x.dtype).itemsize
    return total
