"""One road from a model to a sharded train step.

    built = build(model, optimizer, mesh, "full_shard", loss_fn=loss_fn, precision="bf16")
    state = built.init_state(jax.random.key(0))      # sharded init, never whole on one device
    state, metrics = built.train_step(state, batch)

`build` computes the ShardingPlan once and, from it, the abstract (sharded
`ShapeDtypeStruct`) state and the jitted train / eval steps. Where the state comes
from is the caller's choice, each a method on the result: a sharded init from the
model's init function, materialised params placed onto the plan, params already in
the plan's layout, or a checkpoint restored onto `built.abstract_state`.

The trainer (`fsdp_jax.app.trainer.setup.setup`, via `fsdp_jax.app.trainer.build`), the planner (`fsdp_jax.app.planner.abstract_step.build_step`)
the drop-in entry point (`fsdp_jax.train.shard_model.shard_model`) and `init_train_state` all call `build`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh

from fsdp_jax.errors import StateError
from fsdp_jax.model.fns import ModelFns
from fsdp_jax.model.variables import check_structure
from fsdp_jax.sharding.offload import fetch, on_device, store_state
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.rule_table import Rules
from fsdp_jax.sharding.strategy import ShardingPlan, Strategy, make_plan
from fsdp_jax.sharding.thresholds import (
    DEFAULT_MAX_REPLICATED_FRACTION,
    DEFAULT_MIN_REPLICATED_BYTES,
    DEFAULT_MIN_SHARD_SIZE,
)
from fsdp_jax.train.state import TrainState, abstract_state, state_shardings
from fsdp_jax.train.step import CompiledStep, make_eval_step, make_train_step
from fsdp_jax.train.step_parts import LossFn
from fsdp_jax.train.trainable import trainable_leaves


@dataclasses.dataclass(frozen=True)
class Built:
    """What `build` returns.

    `plan`: shardings of params (at rest and in compute), grads, optimizer state and
    batch. `abstract_state`: the TrainState as sharded ShapeDtypeStructs (AOT
    compile target, checkpoint restore target). `train_step` / `eval_step`: jitted
    steps (None without a `loss_fn`). `model`: anything with `init(rng) -> params`
    and `abstract_params` (a `fsdp_jax.model.fns.ModelFns`)."""

    model: Any
    optimizer: optax.GradientTransformation
    plan: ShardingPlan
    abstract_state: TrainState
    train_step: CompiledStep | None
    eval_step: CompiledStep | None

    @property
    def mesh(self) -> Mesh:
        return self.plan.mesh

    def _init_from(self, params_fn, *args, donate: bool = False, state_fn=None) -> TrainState:
        optimizer = self.optimizer
        dtypes = self.abstract_state.params
        state_dtypes = self.abstract_state.model_state

        plan = self.plan

        def init(*a):  # on the device; offloaded parts then go to host memory
            # master params in the planned dtype (precision's param_dtype), optimizer state after them
            p = jax.tree.map(lambda x, d: x.astype(d.dtype), params_fn(*a), dtypes)
            p = fetch(p, plan.params)
            ms = None
            if state_fn is not None:
                ms = state_fn(*a)
                check_structure(ms, state_dtypes, "the model's initial state")
                ms = jax.tree.map(lambda x, d: jnp.asarray(x).astype(d.dtype), ms, state_dtypes)
            st = TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=optimizer.init(p), model_state=ms)
            return store_state(st, plan)

        with jax.set_mesh(self.plan.mesh):
            return jax.jit(init, out_shardings=state_shardings(self.plan), donate_argnums=(0,) if donate else ())(*args)

    def init_state(self, rng: jax.Array) -> TrainState:
        """Step-0 state from `model.init(rng)`, created shard by shard in the plan's layout."""
        if self.model.init is None:
            raise ValueError("this model has no init function (it was given as materialised params): use place(params)")
        state_fn = getattr(self.model, "init_state", None) if self.plan.model_state is not None else None
        return self._init_from(self.model.init, rng, state_fn=state_fn)

    def place(self, params, model_state=None) -> TrainState:
        """Step-0 state around materialised `params` (host or device arrays, any layout),
        copied into the plan's layout (the caller's arrays are never aliased, since the
        step donates its state), with fresh optimizer state. A model with state needs
        its materialised `model_state` too."""
        if (model_state is None) != (self.plan.model_state is None):
            raise StateError(
                "place: this model has state; pass place(params, model_state)"
                if model_state is None
                else "place: model_state given for a model without state"
            )
        with jax.set_mesh(self.plan.mesh):
            p = jax.device_put(params, on_device(self.plan.params), may_alias=False)
            if model_state is None:
                return self._init_from(lambda x: x, p)
            check_structure(model_state, self.abstract_state.model_state, "place: model_state")
            ms = jax.device_put(model_state, self.plan.model_state, may_alias=False)
        return self._init_from(lambda x, m: x, p, ms, state_fn=lambda x, m: m)

    def state_from_params(self, params) -> TrainState:
        """Step-0 state around `params` already in `plan.params` layout (donated: do not
        use `params` afterwards), with fresh optimizer state. Models without
        non-trainable state only (else `place(params, model_state)`)."""
        if self.plan.model_state is not None:
            raise StateError(
                "state_from_params: this model has state; use place(params, model_state) or init_state(rng)"
            )
        return self._init_from(lambda x: x, params, donate=True)


def with_param_dtype(model, dtype, trainable: Any = None, frozen_dtype=None):
    """`model` (a dataclass with `abstract_params` and `init`) whose floating params
    are `dtype`: its abstract params say so and its init casts. Unchanged when
    they already are. With `trainable` (`fsdp_jax.train.trainable`), frozen leaves are
    `frozen_dtype` instead (no master copy of what the step never updates)."""
    keep = None if trainable is None else trainable_leaves(model.abstract_params, trainable)
    treedef = jax.tree.structure(model.abstract_params)
    targets = [jnp.dtype(dtype if keep is None or k else frozen_dtype) for k in keep or [True] * treedef.num_leaves]

    def cast_all(tree, cast):
        return treedef.unflatten([cast(x, t) for x, t in zip(treedef.flatten_up_to(tree), targets)])

    def cast_dtype(d, t):
        return t if jnp.issubdtype(d, jnp.floating) else d

    if all(cast_dtype(x.dtype, t) == x.dtype for x, t in zip(jax.tree.leaves(model.abstract_params), targets)):
        return model
    abstract = cast_all(model.abstract_params, lambda x, t: jax.ShapeDtypeStruct(x.shape, cast_dtype(x.dtype, t)))
    init = model.init
    if init is not None:

        def init(rng, _init=model.init):
            return cast_all(_init(rng), lambda x, t: x.astype(cast_dtype(x.dtype, t)))

    return dataclasses.replace(model, init=init, abstract_params=abstract)


def build(
    model,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    strategy: str | Strategy = "full_shard",
    *,
    loss_fn: LossFn | None = None,
    logical_axes: Any = None,
    rules: Rules | None = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    max_replicated_fraction: float | None = DEFAULT_MAX_REPLICATED_FRACTION,
    min_replicated_bytes: int = DEFAULT_MIN_REPLICATED_BYTES,
    has_aux: bool = False,
    offload: str = "none",
    **step_options,
) -> Built:
    """Plan, abstract state and steps for `model` under `strategy` on `mesh`.

    `model`: a `ModelFns` (`from_nnx`, `from_linen`) or anything with
    `abstract_params`, `logical_axes` and `init` (a dataclass). `logical_axes`
    overrides the model's names. `rules`, `min_shard_size`, `max_replicated_fraction`,
    `min_replicated_bytes`: as in `make_plan`. The precision's `param_dtype` is the
    dtype of the master params: floating params (and so the optimizer state that
    follows them, e.g. Adam's moments) are stored in it, whatever the model's init
    returns (without `precision`: the model's own dtypes); frozen params (not `trainable`)
    in the policy's `frozen_storage_dtype` instead. With `loss_fn(params,
    batch)`, `step_options` go to `make_train_step` (microbatches, clip_norm, precision, remat, skip_nonfinite,
    donate, trainable, rng); `precision` also goes to `make_eval_step`. A model with
    non-trainable state (`model.abstract_model_state`, `fsdp_jax.model.variables`) gets it
    planned, initialised (`model.init_state`) and carried in `TrainState.model_state`;
    a model that draws its own random numbers (`model.needs_rng`) needs `rng`. `offload`
    ("none" | "optimizer" | "optimizer+params"): state kept in host memory between
    steps (`fsdp_jax.sharding.offload`).
    """
    axes_ = model.logical_axes if logical_axes is None else logical_axes
    if step_options.get("precision") is not None:  # no precision given: the model's own dtypes
        policy = Policy.parse(step_options["precision"])
        trainable = step_options.get("trainable")
        model = with_param_dtype(model, policy.param_dtype, trainable, policy.frozen_storage_dtype)
    abs_ms = getattr(model, "abstract_model_state", None)
    plan = make_plan(
        model.abstract_params,
        optimizer,
        mesh,
        strategy,
        axes_,
        rules,
        min_shard_size,
        max_replicated_fraction,
        min_replicated_bytes,
        offload=offload,
        abstract_model_state=abs_ms,
        model_state_axes=getattr(model, "model_state_axes", None),
    )
    abstract = abstract_state(plan, model.abstract_params, optimizer, abs_ms)
    train_step = eval_step = None
    if loss_fn is not None:
        needs_rng = getattr(model, "needs_rng", False)
        if needs_rng and step_options.get("rng") is None:
            raise StateError(
                "build: the model draws random numbers (NNX Rngs) but the step "
                "has no run key; pass rng=jax.random.key(seed)"
            )
        train_step = make_train_step(loss_fn, optimizer, plan, has_aux=has_aux, **step_options)
        eval_step = make_eval_step(
            loss_fn,
            plan,
            precision=step_options.get("precision"),
            has_aux=has_aux,
            extended=needs_rng or step_options.get("rng") is not None,
        )
    return Built(
        model=model, optimizer=optimizer, plan=plan, abstract_state=abstract, train_step=train_step, eval_step=eval_step
    )


def init_train_state(
    init_params: Callable[[jax.Array], Any],
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    rng: jax.Array,
    strategy: str | Strategy = "full_shard",
    logical_axes=None,
    rules: Rules | None = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    max_replicated_fraction: float | None = DEFAULT_MAX_REPLICATED_FRACTION,
    offload: str = "none",
) -> tuple[TrainState, ShardingPlan]:
    """Initialise params and optimizer state directly in their sharded layout.

    `init_params(rng)` returns the param tree (plain arrays). `logical_axes`: a
    matching tree of logical-name tuples, or None for the fallback rule. `offload`:
    which state rests in host memory (`fsdp_jax.sharding.offload`).
    Returns the sharded TrainState (step 0) and the ShardingPlan used.
    """
    model = ModelFns(
        init=init_params, apply=None, logical_axes=logical_axes, abstract_params=jax.eval_shape(init_params, rng)
    )
    built = build(
        model,
        optimizer,
        mesh,
        strategy,
        rules=rules,
        min_shard_size=min_shard_size,
        max_replicated_fraction=max_replicated_fraction,
        offload=offload,
    )
    return built.init_state(rng), built.plan
