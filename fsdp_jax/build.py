"""One road from a model to a sharded train step.

    built = build(model, optimizer, mesh, "full_shard", loss_fn=loss_fn, precision="bf16")
    state = built.init_state(jax.random.key(0))      # sharded init, never whole on one device
    state, metrics = built.train_step(state, batch)

`build` computes the ShardingPlan once and, from it, the abstract (sharded
`ShapeDtypeStruct`) state and the jitted train / eval steps. Where the state comes
from is the caller's choice, each a method on the result: a sharded init from the
model's init function, materialised params placed onto the plan, params already in
the plan's layout, or a checkpoint restored onto `built.abstract_state`.

The trainer (`fsdp_jax.app.loop.setup`), the planner (`fsdp_jax.app.step_build.build_step`)
and the drop-in entry point (`fsdp_jax.adapters.shard_model`) all call `build`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from fsdp_jax import offload as offload_lib
from fsdp_jax import rules as rl
from fsdp_jax.precision import Policy
from fsdp_jax.state import TrainState, abstract_state, state_shardings
from fsdp_jax.step import CompiledStep, LossFn, make_eval_step, make_train_step
from fsdp_jax.strategy import ShardingPlan, Strategy, make_plan


@dataclasses.dataclass(frozen=True)
class Built:
    """What `build` returns.

    `plan`: shardings of params (at rest and in compute), grads, optimizer state and
    batch. `abstract_state`: the TrainState as sharded ShapeDtypeStructs (AOT
    compile target, checkpoint restore target). `train_step` / `eval_step`: jitted
    steps (None without a `loss_fn`). `model`: anything with `init(rng) -> params`
    and `abstract_params` (a `fsdp_jax.adapters.ModelFns`)."""
    model: Any
    optimizer: optax.GradientTransformation
    plan: ShardingPlan
    abstract_state: TrainState
    train_step: CompiledStep | None
    eval_step: CompiledStep | None

    @property
    def mesh(self) -> Mesh:
        return self.plan.mesh

    def _init_from(self, params_fn, *args, donate: bool = False) -> TrainState:
        optimizer = self.optimizer
        dtypes = self.abstract_state.params

        plan = self.plan

        def init(*a):  # on the device; offloaded parts then go to host memory
            # master params in the planned dtype (precision's param_dtype), optimizer state after them
            p = jax.tree.map(lambda x, d: x.astype(d.dtype), params_fn(*a), dtypes)
            p = offload_lib.fetch(p, plan.params)
            st = TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p))
            return offload_lib.store_state(st, plan)
        with jax.set_mesh(self.plan.mesh):
            return jax.jit(init, out_shardings=state_shardings(self.plan),
                           donate_argnums=(0,) if donate else ())(*args)

    def init_state(self, rng: jax.Array) -> TrainState:
        """Step-0 state from `model.init(rng)`, created shard by shard in the plan's layout."""
        if self.model.init is None:
            raise ValueError("this model has no init function (it was given as materialised "
                             "params): use place(params)")
        return self._init_from(self.model.init, rng)

    def place(self, params) -> TrainState:
        """Step-0 state around materialised `params` (host or device arrays, any layout),
        copied into the plan's layout (the caller's arrays are never aliased, since the
        step donates its state), with fresh optimizer state."""
        with jax.set_mesh(self.plan.mesh):
            p = jax.device_put(params, offload_lib.on_device(self.plan.params), may_alias=False)
        return self._init_from(lambda x: x, p)

    def state_from_params(self, params) -> TrainState:
        """Step-0 state around `params` already in `plan.params` layout (donated: do not
        use `params` afterwards), with fresh optimizer state."""
        return self._init_from(lambda x: x, params, donate=True)


def with_param_dtype(model, dtype):
    """`model` (a dataclass with `abstract_params` and `init`) whose floating params
    are `dtype`: its abstract params say so and its init casts. Unchanged when
    they already are."""
    dtype = jnp.dtype(dtype)

    def cast_dtype(d):
        return dtype if jnp.issubdtype(d, jnp.floating) else d
    leaves = jax.tree.leaves(model.abstract_params)
    if all(cast_dtype(x.dtype) == x.dtype for x in leaves):
        return model
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, cast_dtype(x.dtype)),
                            model.abstract_params)
    init = model.init
    if init is not None:
        def init(rng, _init=model.init):
            return jax.tree.map(lambda x: x.astype(cast_dtype(x.dtype)), _init(rng))
    return dataclasses.replace(model, init=init, abstract_params=abstract)


def build(model, optimizer: optax.GradientTransformation, mesh: Mesh,
          strategy: str | Strategy = "full_shard", *, loss_fn: LossFn | None = None,
          logical_axes: Any = None, rules: rl.Rules | None = None,
          min_shard_size: int = rl.DEFAULT_MIN_SHARD_SIZE,
          max_replicated_fraction: float | None = rl.DEFAULT_MAX_REPLICATED_FRACTION,
          min_replicated_bytes: int = rl.DEFAULT_MIN_REPLICATED_BYTES,
          has_aux: bool = False, offload: str = "none", **step_options) -> Built:
    """Plan, abstract state and steps for `model` under `strategy` on `mesh`.

    `model`: a `ModelFns` (`from_nnx`, `from_linen`) or anything with
    `abstract_params`, `logical_axes` and `init` (a dataclass). `logical_axes`
    overrides the model's names. `rules`, `min_shard_size`, `max_replicated_fraction`,
    `min_replicated_bytes`: as in `make_plan`. The precision's `param_dtype` is the
    dtype of the master params: floating params (and so the optimizer state that
    follows them, e.g. Adam's moments) are stored in it, whatever the model's init
    returns (without `precision`: the model's own dtypes). With `loss_fn(params,
    batch)`, `step_options` go to `make_train_step` (microbatches, clip_norm, precision, remat, skip_nonfinite,
    donate, trainable); `precision` also goes to `make_eval_step`. `offload`
    ("none" | "optimizer" | "optimizer+params"): state kept in host memory between
    steps (`fsdp_jax.offload`).
    """
    axes_ = model.logical_axes if logical_axes is None else logical_axes
    if step_options.get("precision") is not None:  # no precision given: the model's own dtypes
        model = with_param_dtype(model, Policy.parse(step_options["precision"]).param_dtype)
    plan = make_plan(model.abstract_params, optimizer, mesh, strategy, axes_, rules,
                     min_shard_size, max_replicated_fraction, min_replicated_bytes,
                     offload=offload)
    abstract = abstract_state(plan, model.abstract_params, optimizer)
    train_step = eval_step = None
    if loss_fn is not None:
        train_step = make_train_step(loss_fn, optimizer, plan, has_aux=has_aux, **step_options)
        eval_step = make_eval_step(loss_fn, plan, precision=step_options.get("precision"),
                                   has_aux=has_aux)
    return Built(model=model, optimizer=optimizer, plan=plan, abstract_state=abstract,
                 train_step=train_step, eval_step=eval_step)
