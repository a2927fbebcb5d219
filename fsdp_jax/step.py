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
6. the old state is donated, so params and optimizer state are updated in place.
7. with host offload (`plan.offload`), host-resident params are brought to the device
   before 3, offloaded optimizer state (and f32 master params) only after the grad norm
   of 5 exists, and the new state is written back to host memory (`fsdp_jax.offload`).
Activation constraints in the model (`flax.linen.with_logical_constraint`) resolve
through the same rules table, made current while the step is traced.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from jax.sharding import NamedSharding, PartitionSpec as P

import fsdp_jax.offload as offload_lib
import fsdp_jax.remat as remat_lib
from fsdp_jax import rules as rl
from fsdp_jax.precision import Policy, cast_params_for_compute
from fsdp_jax.state import TrainState, state_shardings
from fsdp_jax.strategy import ShardingPlan, batch_divisor

LossFn = Callable[[Any, Any], Any]  # (params, batch) -> loss or (loss, aux)


class BatchError(ValueError):
    """A batch whose leading dim cannot be split over the devices / microbatches."""


@contextlib.contextmanager
def sharding_context(plan: ShardingPlan):
    """Make `plan`'s mesh and logical rules current (for tracing models that call
    `flax.linen.with_logical_constraint`)."""
    with jax.set_mesh(plan.mesh), nn.logical_axis_rules(rl.flax_rules(plan.rules)):
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
                f"batch leaf {rl.path_str(path) or '<root>'} has leading dim {b}, which must be "
                f"divisible by microbatches ({microbatches}) x data x fsdp ({n}) = "
                f"{n * microbatches}; change the global batch size or the mesh")


def _split_microbatches(batch, k: int):
    # (B, ...) -> (B/k, k, ...) keeps each device's rows on that device; microbatch j
    # takes rows j, j+k, j+2k, ... so every microbatch spans all devices.
    return jax.tree.map(lambda x: jnp.moveaxis(x.reshape(x.shape[0] // k, k, *x.shape[1:]), 1, 0), batch)


class _Wrt:
    """What the step differentiates: the whole param tree (`trainable` None, the
    default) or the list of trainable leaves, with frozen leaves held constant."""

    def __init__(self, params, trainable):
        self.leaves, self.treedef = jax.tree.flatten(params)
        self.keep = None if trainable is None else trainable_leaves(params, trainable)

    def select(self, tree):
        """`tree` (params-shaped) as the differentiated argument: itself, or its trainable leaves."""
        if self.keep is None:
            return tree
        return [x for x, k in zip(self.treedef.flatten_up_to(tree), self.keep) if k]

    def join(self, x):
        """The full param tree from the differentiated argument and the frozen leaves."""
        if self.keep is None:
            return x
        it = iter(x)
        return self.treedef.unflatten([next(it) if k else p for p, k in zip(self.leaves, self.keep)])

    def full_grads(self, grads, grad_sh):
        """Params-shaped grads: zeros (in the grad layout) for frozen leaves."""
        if self.keep is None:
            return grads
        it = iter(grads)
        out = [next(it) if k else jax.lax.with_sharding_constraint(jnp.zeros(p.shape, p.dtype), s)
               for p, k, s in zip(self.leaves, self.keep, self.treedef.flatten_up_to(grad_sh))]
        return self.treedef.unflatten(out)


def trainable_leaves(params, trainable) -> list[bool]:
    """One Python bool per leaf of `params` from `trainable`: a tree of bools matching
    `params` (or a prefix of it, broadcast), or a callable `params -> that tree`."""
    mask = trainable(params) if callable(trainable) else trainable
    try:
        full = jax.tree.map(lambda b, sub: jax.tree.map(lambda _: b, sub), mask, params)
        flat = jax.tree.structure(params).flatten_up_to(full)
    except (ValueError, TypeError) as e:
        raise ValueError(f"trainable does not match the params tree: {e}") from None
    bad = [b for b in flat if not isinstance(b, (bool, np.bool_))]
    if bad:
        raise ValueError(f"trainable leaves must be Python bools, got {type(bad[0]).__name__}")
    return [bool(b) for b in flat]


def make_train_step(loss_fn: LossFn, optimizer: optax.GradientTransformation, plan: ShardingPlan, *,
                    microbatches: int = 1, clip_norm: float | None = None,
                    precision: Policy | str | None = None, remat: str = "none",
                    has_aux: bool = False, skip_nonfinite: bool = True,
                    donate: bool = True, trainable: Any = None) -> CompiledStep:
    """A jitted `step(state, batch) -> (state, metrics)` for `plan`'s mesh and strategy.

    `loss_fn(params, batch)` returns a scalar mean loss (or `(loss, aux)` with
    `has_aux`); `params` arrive in the compute dtype. `batch` is a pytree whose
    leaves have a leading global-batch dim. metrics: `loss` (output dtype),
    `grad_norm` (global, before clipping), `skipped` (1 when a non-finite loss or
    grad norm left the state unchanged), plus `aux` when given.

    `trainable` (frozen params, LoRA-style fine-tuning): None (every leaf is
    differentiated), or a tree of Python bools matching params (a prefix is
    broadcast), or a callable `params -> that tree`. Only True leaves are
    differentiated and reduced; frozen leaves get zero grads (constants, never
    computed), so `grad_norm` and clipping cover the trainable leaves only. Pair it
    with an optimizer that leaves frozen leaves alone and keeps no state for them,
    e.g. `optax.multi_transform({"train": tx, "frozen": optax.set_to_zero()}, labels)`.
    """
    if microbatches < 1:
        raise ValueError(f"microbatches must be >= 1, got {microbatches}")
    policy = Policy.parse(precision)
    loss_fn = remat_lib.with_remat(loss_fn, remat)
    clip = optax.clip_by_global_norm(clip_norm) if clip_norm else None
    grad_sh, compute_sh, rest_sh = plan.grads, plan.compute, offload_lib.on_device(plan.params)

    def value_and_grad(params, batch, wrt: _Wrt):
        def f(x):
            pc = cast_params_for_compute(wrt.join(x), policy, rest_sh)
            if compute_sh is not rest_sh:
                pc = jax.lax.with_sharding_constraint(pc, compute_sh)
            out = loss_fn(pc, batch)
            loss, aux = out if has_aux else (out, None)
            return loss.astype(jnp.float32), aux
        (loss, aux), grads = jax.value_and_grad(f, has_aux=True)(wrt.select(params))
        return loss, aux, jax.lax.with_sharding_constraint(grads, wrt.select(grad_sh))

    def step(state: TrainState, batch):
        at_rest = state  # offloaded params come to the device now, for the forward pass
        state = state.replace(params=offload_lib.fetch(state.params, plan.params))
        wrt = _Wrt(state.params, trainable)
        g_sh = wrt.select(grad_sh)
        if microbatches == 1:
            loss, aux, grads = value_and_grad(state.params, batch, wrt)
        else:
            def body(carry, mb):
                acc, loss_sum = carry
                loss, aux, g = value_and_grad(state.params, mb, wrt)
                acc = jax.tree.map(lambda a, b: a + b.astype(a.dtype), acc, g)
                return (jax.lax.with_sharding_constraint(acc, g_sh), loss_sum + loss), aux
            zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, p.dtype), wrt.select(state.params))
            zeros = jax.lax.with_sharding_constraint(zeros, g_sh)
            (acc, loss_sum), aux = jax.lax.scan(body, (zeros, jnp.zeros((), jnp.float32)),
                                                _split_microbatches(batch, microbatches))
            grads = jax.tree.map(lambda g: g / microbatches, acc)
            loss = loss_sum / microbatches
        grads = wrt.full_grads(grads, grad_sh)
        grad_norm = optax.tree.norm(grads)
        if clip is not None:
            grads, _ = clip.update(grads, clip.init(grads))
        # offloaded optimizer state (and f32 master params) come once the grads exist
        state = offload_lib.fetch_state(at_rest, plan, after=grad_norm)
        def apply(st: TrainState, g) -> TrainState:
            updates, opt_state = optimizer.update(g, st.opt_state, st.params)
            return TrainState(step=st.step + 1, params=optax.apply_updates(st.params, updates),
                              opt_state=opt_state)

        ok = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if skip_nonfinite:  # a conditional, not a select over the state: no extra pass over it
            new = jax.lax.cond(ok, apply, lambda st, g: st, state, grads)
        else:
            new = apply(state, grads)
        new = offload_lib.store_state(new, plan)  # back to host memory, where offloaded
        metrics = {"loss": loss.astype(policy.output_dtype), "grad_norm": grad_norm,
                   "skipped": (~ok).astype(jnp.int32)}
        if has_aux:
            metrics["aux"] = aux
        return new, metrics

    sh = state_shardings(plan)
    jitted = jax.jit(step, in_shardings=(sh, plan.batch), out_shardings=(sh, NamedSharding(plan.mesh, P())),
                     donate_argnums=(0,) if donate else ())
    return CompiledStep(jitted, plan, lambda b: check_batch(b, plan, microbatches))


def make_eval_step(loss_fn: LossFn, plan: ShardingPlan, *, precision: Policy | str | None = None,
                   has_aux: bool = False) -> CompiledStep:
    """A jitted `eval_step(params, batch) -> {"loss": ...}` (no state change)."""
    policy = Policy.parse(precision)

    def step(params, batch):
        params = offload_lib.fetch(params, plan.params)
        pc = policy.cast_to_compute(jax.lax.with_sharding_constraint(
            params, offload_lib.on_device(plan.params)))
        out = loss_fn(pc, batch)
        loss = out[0] if has_aux else out
        return {"loss": loss.astype(policy.output_dtype)}

    jitted = jax.jit(step, in_shardings=(plan.params, plan.batch),
                     out_shardings=NamedSharding(plan.mesh, P()))
    return CompiledStep(jitted, plan, lambda b: check_batch(b, plan))
