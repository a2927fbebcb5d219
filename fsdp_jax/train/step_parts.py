"""The train step's parts, each usable and tested alone: `compute_value_and_grad` (cast
in the at-rest layout, lay out for compute, differentiate, grads into the grad layout),
`microbatched` (scanned accumulation over slices of the batch), `clip_grads`,
`apply_update` and `guarded_update` (skip non-finite steps), and `TokenSum`, the loss
averaged over the tokens of the global batch. `fsdp_jax.train.step.make_train_step` composes
them (in the order its module docstring states) and re-exports them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import optax

from fsdp_jax.model import variables
from fsdp_jax.model.variables import StepInput
from fsdp_jax.sharding import offload
from fsdp_jax.sharding.mesh import constrain
from fsdp_jax.sharding.precision import Policy, cast_params_for_compute, lay_out_for_compute, reducing, widens
from fsdp_jax.sharding.strategy import ShardingPlan
from fsdp_jax.train import layer_gather
from fsdp_jax.train.state import TrainState
from fsdp_jax.train.trainable import Trainable

LossFn = Callable[[Any, Any], Any]  # (params, batch) -> loss or (loss, aux); loss: scalar or TokenSum


class TokenSum(NamedTuple):
    """A loss to be averaged over the tokens of the GLOBAL batch: `loss_fn` returns the
    sum of its per-token losses over the (micro)batch it sees and how many tokens
    (unmasked targets) that sum covers. The step adds totals and counts over
    microbatches (and, being a global jitted computation, over devices) and divides
    once: loss = sum of all token losses / number of all tokens, and the gradient is
    that mean's. A scalar loss is instead averaged per microbatch (mean of means),
    which differs from this whenever microbatches hold different token counts."""

    total: Any  # f32 scalar: sum of token losses
    count: Any  # f32 scalar: tokens summed


def normalize(loss, grads):
    """(mean loss, grads of the mean) from a TokenSum and its summed grads; a scalar
    loss and its grads unchanged."""
    if not isinstance(loss, TokenSum):
        return loss, grads
    n = jnp.maximum(loss.count, 1.0)
    return loss.total / n, jax.tree.map(lambda g: (g / n).astype(g.dtype), grads)


def _split_microbatches(batch, k: int):
    # (B, ...) -> (B/k, k, ...) keeps each device's rows on that device; microbatch j
    # takes rows j, j+k, j+2k, ... so every microbatch spans all devices.
    return jax.tree.map(lambda x: jnp.moveaxis(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 1, 0), batch)


GradFn = Callable[[Any, Any], tuple[Any, Any, Any]]  # (params, batch) -> (loss, aux, grads)


def compute_value_and_grad(
    loss_fn: LossFn, policy: Policy, plan: ShardingPlan, wrt: Trainable, has_aux: bool = False
) -> GradFn:
    """`(params, batch) -> (loss f32, aux, grads)`: params are cast to the compute dtype
    in their at-rest layout, laid out for compute (gathered once under
    shard_grad_op), `loss_fn` is differentiated with respect to `wrt`'s leaves, and
    grads come back in the reduce dtype constrained to the grad layout (so their
    cross-device reduction is a reduce-scatter under ZeRO-2/3).

    Under a streamed offload of params (`streams_params`) `params` may hold the stacked
    leaves still in host memory: a model that gathers its own layers brings them to the
    device one layer at a time (`layer_gather.LayerGather.fetch`), and their grads, which
    the transpose of that transfer leaves in host memory, come back to the device once the
    backward pass is done; for any other model they are fetched whole here."""
    grad_sh, compute_sh = plan.grads, plan.compute
    rest_sh = offload.on_device(plan.params)  # host-resident params arrive here first
    lg = layer_gather_for(plan, policy)
    per_use = per_use_gather(plan, policy)

    def for_compute(p, rest, compute):  # a tree, or one leaf and its shardings
        pc = cast_params_for_compute(p, policy, rest)
        if compute_sh is not rest_sh:  # (grads scattered from f32 dots: see precision.matmul)
            pc = lay_out_for_compute(pc, compute, rest) if widens(policy) else constrain(pc, compute)
        return pc

    def grad_fn(params, batch):
        # a model that gathers its own layers (fsdp_jax.train.layer_gather) gets its stacked
        # layer params at rest in the param dtype: it casts and gathers them per layer
        hooked = lg is not None and model_hooks(loss_fn, policy, wrt, params, batch, lg)
        if not hooked:  # host-resident stacked params (a streamed offload) come whole
            params = to_device(params)

        ctx = batch if isinstance(batch, StepInput) else None
        written = variables.from_gradient(None if ctx is None else ctx.state)  # state the backward writes

        def f(x, from_grad=()):
            if written:
                batch_ = ctx._replace(state=variables.put(ctx.state, written, from_grad))
            else:
                batch_ = batch
            full = wrt.join(x)
            host = jax.tree.map(layer_gather.on_host, full)
            if any(jax.tree.leaves(host)):  # the model fetches these per layer (hooked)
                pc = jax.tree.map(
                    lambda layered, h, p, r, c: p if h else constrain(p, r) if layered else for_compute(p, r, c),
                    plan.layered,
                    host,
                    full,
                    rest_sh,
                    compute_sh,
                )
            else:
                pc = for_compute(full, rest_sh, compute_sh)
                if hooked:
                    pc = jax.tree.map(
                        lambda layered, p, c, r: constrain(p, r) if layered else c, plan.layered, full, pc, rest_sh
                    )
            with layer_gather.active(lg if hooked else None), layer_gather.gathered_per_use(per_use), reducing(policy):
                out = loss_fn(pc, batch_)
            loss, aux = out if has_aux else (out, None)
            if isinstance(loss, TokenSum):  # differentiate the sum; the count rides along
                return loss.total.astype(jnp.float32), (aux, loss.count.astype(jnp.float32))
            return loss.astype(jnp.float32), (aux, None)

        if written:  # the extended loss's aux is (aux, new state): those leaves from their cotangents
            (loss, (aux, count)), (grads, new) = jax.value_and_grad(f, argnums=(0, 1), has_aux=True)(
                wrt.select(params), variables.take(ctx.state, written)
            )
            aux = (aux[0], variables.put(aux[1], written, new))
        else:
            (loss, (aux, count)), grads = jax.value_and_grad(f, has_aux=True)(wrt.select(params))
        if count is not None:
            loss = TokenSum(loss, count)
        return loss, aux, constrain(to_device(grads), wrt.select(grad_sh))

    return grad_fn


def to_device(tree):
    """Inside jit: the leaves of `tree` in host memory moved to the device (same sharding)."""
    return jax.tree.map(lambda x: jax.device_put(x, jax.memory.Space.Device) if layer_gather.on_host(x) else x, tree)


def model_hooks(loss_fn, policy: Policy, wrt: Trainable, params, batch, lg) -> bool:
    """Does the model gather its own layers (`layer_gather.model_gathers`, traced abstractly)?"""
    full = params if wrt.keep is None else wrt.join(wrt.select(params))
    as_compute = jax.tree.map(  # shapes and compute dtypes (memory kinds aside)
        lambda x: jax.ShapeDtypeStruct(
            x.shape, policy.compute_dtype if jnp.issubdtype(x.dtype, jnp.floating) else x.dtype
        ),
        full,
    )
    return layer_gather.model_gathers(loss_fn, as_compute, batch, lg)


def streams_params(plan: ShardingPlan) -> bool:
    """Does `plan` rest stacked params in host memory under a streamed offload, for a model
    that gathers its own layers to fetch one layer at a time?"""
    o = offload.get_offload(plan.offload)
    return o.layers and plan.layered is not None and any(jax.tree.leaves(plan.layered))


def layer_gather_for(plan: ShardingPlan, policy: Policy) -> layer_gather.LayerGather | None:
    """The per-layer gather a layer-gathering model applies under `plan`: ZeRO-2's
    explicit cast and gather (`gather_once`), and under a streamed offload of params the
    per-layer fetch from host memory for every strategy (cast only, at rest, where the
    strategy is not ZeRO-2); None otherwise, and without logical names. ZeRO-3's
    per-layer gathers stay XLA's: explicit ones measured no better on XLA:GPU
    (hybrid_shard's grads became an all-reduce over every device)."""
    if plan.layered is None:
        return None
    fetch = streams_params(plan)
    if not fetch and (plan.offload != "none" or not plan.strategy.gather_once):
        return None
    return layer_gather.LayerGather(
        mesh=plan.mesh,
        rules=plan.rules,
        shard_axes=plan.strategy.params,
        compute_dtype=policy.compute_dtype,
        reduce_dtype=policy.reduce_dtype,
        keep=plan.strategy.gather_once,
        fetch=fetch,
        explicit=plan.strategy.gather_once,
    )


def per_use_gather(plan: ShardingPlan, policy: Policy) -> layer_gather.LayerGather | None:
    """The layout of params that rest sharded and are gathered by XLA where used (ZeRO-3:
    full_shard, hybrid_shard), for `layer_gather.gathered_per_use`; None for the others."""
    s = plan.strategy
    if s.gather_once or not s.params:
        return None
    return layer_gather.LayerGather(plan.mesh, plan.rules, s.params, policy.compute_dtype, policy.reduce_dtype)


def microbatched(
    grad_fn: GradFn, microbatches: int, grad_shardings=None, grads_like: Callable[[Any], Any] = lambda params: params
) -> GradFn:
    """`grad_fn` over `microbatches` slices of the batch, scanned: mean loss, mean
    grads (summed into an accumulator laid out as `grad_shardings`, a tree matching
    the grads, or None) and the slices' aux stacked on a leading dim; for a `TokenSum`
    loss the summed TokenSum and summed grads instead (`normalize` divides once by the
    total count). A `model_state.StepInput` batch threads the model state through the
    slices (aux is then `(stacked aux, final state)`, as grad_fn's is `(aux, state)`). Slice j takes
    rows j, j+k, j+2k, ... so each slice still spans every device. `grads_like(params)`
    has the grads' shapes and dtypes (default: params). microbatches=1 is `grad_fn`."""
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    if microbatches == 1:
        return grad_fn

    def place(tree):
        return tree if grad_shardings is None else constrain(tree, grad_shardings)

    def run(params, batch):
        ctx = batch if isinstance(batch, StepInput) else None
        data = batch if ctx is None else ctx.batch

        def body(carry, mb):
            acc, loss_sum, mstate = carry  # mstate: None (no leaves) without model state
            if ctx is not None:  # the model's state carried from slice to slice
                j, mb = mb
                mb = ctx.for_microbatch(mb, mstate, j)
            loss, aux, g = grad_fn(params, mb)
            if ctx is not None:
                aux, mstate = aux
            acc = jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)
            return (place(acc), jax.tree.map(jnp.add, loss_sum, loss), mstate), aux

        zeros = place(jax.tree.map(lambda g: jnp.zeros(g.shape, g.dtype), grads_like(params)))
        xs = _split_microbatches(data, microbatches)
        first = jax.tree.map(lambda x: x[0], xs)
        mb0 = first if ctx is None else ctx.for_microbatch(first, ctx.state, 0)
        loss_shape = jax.eval_shape(lambda: grad_fn(params, mb0)[0])
        loss0 = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), loss_shape)
        init = (zeros, loss0, None if ctx is None else ctx.state)
        (acc, loss_sum, mstate), aux = jax.lax.scan(body, init, xs if ctx is None else (jnp.arange(microbatches), xs))
        if ctx is not None:
            aux = (aux, mstate)
        if isinstance(loss_sum, TokenSum):
            return loss_sum, aux, acc
        return loss_sum / microbatches, aux, jax.tree.map(lambda g: g / microbatches, acc)

    return run


def clip_grads(grads, clip_norm: float | None):
    """(grads scaled to global norm <= clip_norm (unchanged when None), the global
    norm before clipping, taken across shards)."""
    norm = optax.tree.norm(grads)
    if clip_norm:
        grads, _ = optax.clip_by_global_norm(clip_norm).update(grads, optax.EmptyState())
    return grads, norm


@jax.named_scope("optimizer")
def apply_update(optimizer: optax.GradientTransformation, state: TrainState, grads) -> TrainState:
    """One optax update of `state` (in its sharded layout) by `grads`."""
    updates, opt_state = optimizer.update(grads, state.opt_state, state.params)
    return state.replace(step=state.step + 1, params=optax.apply_updates(state.params, updates), opt_state=opt_state)


def guarded_update(
    optimizer: optax.GradientTransformation, state: TrainState, grads, ok, skip_nonfinite: bool = True
) -> TrainState:
    """`apply_update` when `ok` (a traced bool: loss and grad norm finite); the state
    unchanged when not and `skip_nonfinite`.

    The skip is a per-leaf select, not a `lax.cond` over the whole update: XLA fuses
    each select into the fusion that computes that leaf's update, which writes into
    the donated buffer, so skipping costs no copy. A `cond` makes the update a
    separate computation whose result XLA:GPU materialises in fresh buffers: a whole
    extra copy of the state in temp (Llama-2-7B on 8 x H100: 107.8 vs 34.6 GB temp
    under no_shard; tests/test_targets.py checks this on a GPU-target compile)."""
    new = apply_update(optimizer, state, grads)
    if not skip_nonfinite:
        return new
    return jax.tree.map(lambda n, o: jnp.where(ok, n, o), new, state)
