"""The jitted FSDP train and eval steps.

`make_train_step` wires, in this order:
1. the batch arrives sharded on its leading dim over (`data`, `fsdp`);
2. it is split into `microbatches` slices, each still spread over every device;
3. per microbatch, params are cast to the compute dtype in their at-rest (sharded)
   layout, then constrained to the compute layout (gathered once per step under
   shard_grad_op; under full_shard XLA gathers each layer inside the layer loop);
4. the loss (optionally remat-wrapped) is differentiated (with respect to the
   `trainable` leaves only, when given: frozen leaves get no grads); gradients come back in
   the reduce dtype, constrained to the grad layout (reduce-scatter under
   ZeRO-2/3, all-reduce under ZeRO-1/DDP) and summed into an accumulator that
   lives in that layout;
5. the global grad norm is taken across shards, grads are clipped, optax updates
   the state in its sharded layout, and non-finite steps are skipped;
   (each of 2-5 is its own function: `microbatched`, `compute_value_and_grad`,
   `Trainable`, `clip_grads`, `guarded_update`, in `fsdp_jax.train.step_parts`, re-exported here)
6. the old state is donated, so params and optimizer state are updated in place.
7. with host offload (`plan.offload`), host-resident params are brought to the device
   before 3, offloaded optimizer state (and f32 master params) only after the grad norm
   of 5 exists, and the new state is written back to host memory (`fsdp_jax.sharding.offload`);
   a `:streamed` offload updates the leaves stacked over layers one layer at a time
   (`fsdp_jax.train.stream_update`; the whole-leaf update when the optimizer is not elementwise).
8. `post_update(params, aux) -> params`, when given: a rule that moves params by the step's
   statistics rather than by a gradient (as torchtitan's optimizer step hook moves its MoE
   expert bias), applied to the new params after the update and the frozen leaves' restore,
   with the loss's aux (stacked over microbatches when there are several); the leaves it
   changes are kept only when the step is.
Models with non-trainable state (BatchNorm statistics) or randomness (dropout) take
the extended call `loss_fn(params, batch, state=, rng=, train=)` and return their new
state; it rides through 2-5 beside the loss and is kept or skipped with the update
(`fsdp_jax.model.variables`).
Activation constraints in the model (`flax.linen.with_logical_constraint`) resolve
through the same rules table, made current while the step is traced. On a mesh of
Explicit axes (`make_mesh(..., axis_types="explicit")`) every layout change above is
a `jax.sharding.reshard` instead of a sharding constraint (`fsdp_jax.sharding.mesh.constrain`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.errors import BatchError
from fsdp_jax.model.variables import StepInput, extended_loss, run_key, step_key, with_model_state
from fsdp_jax.sharding import offload, rules
from fsdp_jax.sharding.mesh import constrain
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.remat import with_remat
from fsdp_jax.sharding.strategy import ShardingPlan, batch_divisor
from fsdp_jax.targets.xla_flags import step_compiler_options
from fsdp_jax.train import stream_update
from fsdp_jax.train.state import TrainState, state_shardings
from fsdp_jax.train.step_parts import (
    LossFn,
    TokenSum,
    clip_grads,
    compute_value_and_grad,
    guarded_update,
    layer_gather_for,
    microbatched,
    model_hooks,
    normalize,
    streams_params,
)
from fsdp_jax.train.trainable import Trainable


@contextlib.contextmanager
def sharding_context(plan: ShardingPlan):
    """Make `plan`'s mesh and logical rules current (for tracing models that call
    `flax.linen.with_logical_constraint`)."""
    with jax.set_mesh(plan.mesh), nn.logical_axis_rules(rules.flax_rules(plan.rules)):
        yield


class CompiledStep:
    """A jitted step that traces under the plan's sharding context.

    Call it like the function; `.lower(*args)` gives the AOT lowering
    (`.compile().memory_analysis()`, `.as_text()`).
    """

    def __init__(self, fn, plan: ShardingPlan, check_batch: Callable[[Any], None]):
        self.jitted = fn
        self.plan = plan
        self._check_batch = check_batch

    def __call__(self, *args):
        self._check_batch(args[-1])
        with sharding_context(self.plan):
            return self.jitted(*args)

    def lower(self, *args):
        self._check_batch(args[-1])
        with sharding_context(self.plan):
            return self.jitted.lower(*args)


def check_batch(batch, plan: ShardingPlan, microbatches: int = 1) -> None:
    """Raise BatchError unless every leaf's leading dim divides by
    microbatches x data x fsdp."""
    n = batch_divisor(plan.mesh)
    for path, x in jax.tree_util.tree_flatten_with_path(batch)[0]:
        b = x.shape[0] if x.shape else None
        if b is None or b % (n * microbatches):
            raise BatchError(
                f"batch leaf {rules.path_str(path) or '<root>'} has leading dim {b}, which must be "
                f"divisible by microbatches ({microbatches}) x data x fsdp ({n}) = "
                f"{n * microbatches}; change the global batch size or the mesh"
            )


def make_train_step(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    plan: ShardingPlan,
    *,
    microbatches: int = 1,
    clip_norm: float | None = None,
    precision: Policy | str | None = None,
    remat: str = "none",
    has_aux: bool = False,
    skip_nonfinite: bool = True,
    donate: bool = True,
    trainable: Any = None,
    rng: Any = None,
    post_update: Callable | None = None,
) -> CompiledStep:
    """A jitted `step(state, batch) -> (state, metrics)` for `plan`'s mesh and strategy.

    `loss_fn(params, batch)` returns a scalar mean loss, or a `TokenSum(total, count)`
    to average over the tokens of the whole global batch (masked fine-tuning
    losses: every microbatch and device weighs by its token count; metrics then hold
    `tokens`, the global count), or `(loss, aux)` with `has_aux`; `params` arrive in
    the compute dtype. `batch` is a pytree whose leaves have a leading global-batch dim. metrics: `loss` (output dtype),
    `grad_norm` (global, before clipping), `skipped` (1 when a non-finite loss or
    grad norm left the state unchanged), plus `aux` when given (stacked over
    microbatches when there are several).

    The step is the composition `microbatched(compute_value_and_grad)` -> `Trainable.full_grads` ->
    `clip_grads` -> `guarded_update` (-> `post_update`, given: step 8 above), each usable alone.

    `trainable` (frozen params, LoRA-style fine-tuning): None (every leaf is
    differentiated), or a tree of Python bools matching params (a prefix is
    broadcast), or a callable `params -> that tree`. Only True leaves are
    differentiated and reduced; frozen leaves get zero grads (constants, never
    computed), so `grad_norm` and clipping cover the trainable leaves only. Pair it
    with an optimizer that leaves frozen leaves alone and keeps no state for them,
    e.g. `optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)`.

    Model state and randomness (`fsdp_jax.model.variables`): when `plan.model_state` is not
    None or `rng` (the run key: a typed key, key data or an int seed) is given,
    `loss_fn` is called `loss_fn(params, batch, state=state.model_state, rng=key,
    train=True)` with key `fold_in(rng, state.step)` (None without `rng`), and, with
    model state, returns `(loss, new_state)` (`((loss, aux), new_state)` with
    `has_aux`); the new state is kept when the step is and skipped when it is not."""
    if microbatches < 1 or (post_update is not None and not has_aux):
        bad = f"microbatches must be >= 1, got {microbatches}" if microbatches < 1 else "post_update needs has_aux"
        raise ValueError(bad)
    policy = Policy.parse(precision)
    key_data = run_key(rng)
    extended = plan.model_state is not None or key_data is not None
    user_aux = has_aux
    if extended:  # the wrapped loss returns (loss, (aux, new model state))
        loss_fn, has_aux = extended_loss(loss_fn, plan.model_state is not None, user_aux), True
    loss_fn = with_remat(loss_fn, remat)
    loss_fn = jax.named_scope("forward")(loss_fn)  # profiler names; backward: transpose(jvp(forward))
    step = _train_step_fn(
        loss_fn,
        optimizer,
        plan,
        policy,
        microbatches=microbatches,
        clip_norm=clip_norm,
        has_aux=has_aux,
        user_aux=user_aux,
        skip_nonfinite=skip_nonfinite,
        trainable=trainable,
        key_data=key_data,
        extended=extended,
        post_update=post_update,
    )
    sh = state_shardings(plan)
    jitted = jax.jit(
        step,
        in_shardings=(sh, plan.batch),
        out_shardings=(sh, NamedSharding(plan.mesh, P())),
        donate_argnums=(0,) if donate else (),
        compiler_options=step_compiler_options(plan.mesh.devices.flat, bool(plan.strategy.params)),
    )
    return CompiledStep(jitted, plan, lambda b: check_batch(b, plan, microbatches))


def _train_step_fn(
    loss_fn: LossFn,
    optimizer: optax.GradientTransformation,
    plan: ShardingPlan,
    policy: Policy,
    *,
    microbatches: int,
    clip_norm: float | None,
    has_aux: bool,
    user_aux: bool,
    skip_nonfinite: bool,
    trainable: Any,
    key_data: Any,
    extended: bool,
    post_update: Callable | None = None,
) -> Callable[[TrainState, Any], tuple[TrainState, dict[str, Any]]]:
    """The body of `make_train_step`'s step, `(state, batch) -> (state, metrics)`, for the
    already wrapped `loss_fn` (`has_aux`: whether it returns aux; `user_aux`: whether the
    caller's did, so metrics hold `aux`; `extended`: it takes the model state and key)."""

    def step(state: TrainState, batch):
        if extended:  # the batch travels with the model state and the step's key
            batch = StepInput(batch, state.model_state, None if key_data is None else step_key(key_data, state.step))
        at_rest = state  # offloaded params come to the device now, for the forward pass
        wrt = Trainable(state.params, trainable)
        fetch_sh = plan.params
        if streams_params(plan) and model_hooks(
            loss_fn, policy, wrt, state.params, batch, layer_gather_for(plan, policy)
        ):
            # ... except the stacked ones of a streamed offload: the model's layer loop fetches them
            fetch_sh = jax.tree.map(
                lambda layered, s: offload.on_device(s) if layered else s, plan.layered, plan.params
            )
        state = state.replace(params=offload.fetch(state.params, fetch_sh))
        wrt = Trainable(state.params, trainable)
        grad_fn = microbatched(
            compute_value_and_grad(loss_fn, policy, plan, wrt, has_aux),
            microbatches,
            wrt.select(plan.grads),
            wrt.select,
        )
        loss, aux, grads = grad_fn(state.params, batch)
        tokens = loss.count if isinstance(loss, TokenSum) else None
        loss, grads = normalize(loss, grads)
        grads, grad_norm = clip_grads(grads, clip_norm)  # over the trainable leaves
        grads = wrt.full_grads(grads, plan.grads)
        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if stream_update.streamable(plan, optimizer, at_rest):  # the stacked leaves layer by layer
            params, opt_state = jax.lax.optimization_barrier(((at_rest.params, at_rest.opt_state), grad_norm))[0]
            state = at_rest.replace(params=params, opt_state=opt_state)
            new = stream_update.streamed_update(optimizer, state, grads, ok, plan, skip_nonfinite)
        else:  # offloaded optimizer state (and f32 master params) come once the grads exist
            state = offload.fetch_state(at_rest, plan, after=grad_norm)
            new = guarded_update(optimizer, state, grads, ok, skip_nonfinite)
        new = new.replace(params=wrt.frozen_from(new.params, state.params))  # frozen: the same buffers
        if extended:
            new, aux = with_model_state(new, aux, state, ok, skip_nonfinite)
        if post_update is not None:
            new = new.replace(params=_post_update(post_update, new.params, aux, ok, skip_nonfinite))
        new = offload.store_state(new, plan)  # back to host memory, where offloaded
        metrics = {"loss": loss.astype(policy.output_dtype), "grad_norm": grad_norm, "skipped": (~ok).astype(jnp.int32)}
        if user_aux:
            metrics["aux"] = aux
        if tokens is not None:
            metrics["tokens"] = tokens  # the global batch's trained (unmasked) tokens
        return new, metrics

    return step


def _post_update(rule: Callable, params, aux, ok, skip_nonfinite: bool):
    """`rule(params, aux)`, its changed leaves kept only when the step is (`ok`)."""
    moved = rule(params, aux)
    if not skip_nonfinite:
        return moved
    return jax.tree.map(lambda n, o: o if n is o else jnp.where(ok, n, o), moved, params)


def make_eval_step(
    loss_fn: LossFn,
    plan: ShardingPlan,
    *,
    precision: Policy | str | None = None,
    has_aux: bool = False,
    extended: bool | None = None,
) -> CompiledStep:
    """A jitted `eval_step(params, batch) -> {"loss": ...}` (no state change); with a
    `TokenSum` loss also `loss_sum` and `tokens`; with `has_aux` also `aux`, the loss's
    metrics (replicated).

    A model with state (`plan.model_state`) is evaluated as `eval_step(params,
    model_state, batch)` through the extended call with `rng=None, train=False`
    (deterministic: no dropout, BatchNorm on its running statistics); the state the
    loss returns is dropped. `extended` (default: whether the model has state): use
    the extended call also for a model without state (dropout only)."""
    policy = Policy.parse(precision)
    stateful = plan.model_state is not None
    extended = stateful if extended is None else extended or stateful

    def step(params, *rest):
        *mstate, batch = rest
        params = offload.fetch(params, plan.params)
        pc = policy.cast_to_compute(constrain(params, offload.on_device(plan.params)))
        aux = None
        if extended:
            loss, (aux, _) = extended_loss(loss_fn, stateful, has_aux, train=False)(
                pc, StepInput(batch, mstate[0] if stateful else None, None)
            )
        else:
            out = loss_fn(pc, batch)
            loss, aux = out if has_aux else (out, None)
        if has_aux:  # the loss's metrics (a preference loss's rewards, a router's statistics)
            return {**_eval_loss(loss, policy), "aux": aux}
        return _eval_loss(loss, policy)

    in_sh = (plan.params, plan.model_state, plan.batch) if stateful else (plan.params, plan.batch)
    jitted = jax.jit(step, in_shardings=in_sh, out_shardings=NamedSharding(plan.mesh, P()))
    return CompiledStep(jitted, plan, lambda b: check_batch(b, plan))


def _eval_loss(loss, policy: Policy) -> dict:
    """`{"loss"}` of an eval step; with a `TokenSum` loss also `loss_sum` and `tokens`."""
    if isinstance(loss, TokenSum):  # the sum and count too, to average over many batches
        total, count = loss.total.astype(jnp.float32), loss.count.astype(jnp.float32)
        return {
            "loss": (total / jnp.maximum(count, 1.0)).astype(policy.output_dtype),
            "loss_sum": total,
            "tokens": count,
        }
    return {"loss": loss.astype(policy.output_dtype)}
