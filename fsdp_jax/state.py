"""Train state, abstract shapes and sharded initialisation.

The full model never lands on one device: `jax.eval_shape` gives shapes,
`fsdp_jax.strategy.make_plan` gives shardings, and `jax.jit(init,
out_shardings=...)` materialises each shard where it lives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from fsdp_jax import rules as rl
from fsdp_jax.strategy import ShardingPlan, Strategy


@dataclasses.dataclass(frozen=True)
class TrainState:
    """step: int32 scalar (replicated); params: master weights; opt_state: optax state;
    model_state: the model's non-trainable variables (Linen `batch_stats`, NNX
    `BatchStat`, ...; `fsdp_jax.model_state`), None for a model without them.

    A pytree whose children are `step`, `params`, `opt_state` and, only when it is not
    None, `model_state`: a state without model state has exactly the tree (paths,
    leaves, checkpoint layout) of the three-field TrainState of earlier releases, so
    their checkpoints restore unchanged."""
    step: jax.Array
    params: Any
    opt_state: Any
    model_state: Any = None

    def replace(self, **changes) -> "TrainState":
        return dataclasses.replace(self, **changes)


def _flatten(s: TrainState):
    names = _FIELDS if s.model_state is not None else _FIELDS[:3]
    return [(jax.tree_util.GetAttrKey(n), getattr(s, n)) for n in names], len(names) == 4


def _unflatten(has_model_state: bool, children) -> TrainState:
    return TrainState(*children) if has_model_state else TrainState(*children, model_state=None)


_FIELDS = ("step", "params", "opt_state", "model_state")
jax.tree_util.register_pytree_with_keys(TrainState, _flatten, _unflatten)


def state_shardings(plan: ShardingPlan) -> TrainState:
    """The NamedSharding tree of a TrainState under `plan`."""
    return TrainState(step=NamedSharding(plan.mesh, P()), params=plan.params,
                      opt_state=plan.opt_state, model_state=plan.model_state)


def abstract_state(plan: ShardingPlan, abstract_params, optimizer, abstract_model_state=None) -> TrainState:
    """TrainState of ShapeDtypeStructs carrying `plan`'s shardings (nothing allocated);
    the target tree for AOT compilation and for checkpoint restore."""
    opt = jax.eval_shape(optimizer.init, abstract_params)
    shapes = TrainState(step=jax.ShapeDtypeStruct((), jnp.int32), params=abstract_params, opt_state=opt,
                        model_state=abstract_model_state)
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s),
                        shapes, state_shardings(plan))


def init_train_state(init_params: Callable[[jax.Array], Any], optimizer: optax.GradientTransformation,
                     mesh: Mesh, rng: jax.Array, strategy: str | Strategy = "full_shard",
                     logical_axes=None, rules: rl.Rules | None = None,
                     min_shard_size: int = rl.DEFAULT_MIN_SHARD_SIZE,
                     max_replicated_fraction: float | None = rl.DEFAULT_MAX_REPLICATED_FRACTION,
                     offload: str = "none") -> tuple[TrainState, ShardingPlan]:
    """Initialise params and optimizer state directly in their sharded layout.

    `init_params(rng)` returns the param tree (plain arrays). `logical_axes`: a
    matching tree of logical-name tuples, or None for the fallback rule. `offload`:
    which state rests in host memory (`fsdp_jax.offload`).
    Returns the sharded TrainState (step 0) and the ShardingPlan used.
    """
    from fsdp_jax.adapters import ModelFns
    from fsdp_jax.build import build
    model = ModelFns(init=init_params, apply=None, logical_axes=logical_axes,
                     abstract_params=jax.eval_shape(init_params, rng))
    built = build(model, optimizer, mesh, strategy, rules=rules, min_shard_size=min_shard_size,
                  max_replicated_fraction=max_replicated_fraction, offload=offload)
    return built.init_state(rng), built.plan


def shard_params(params, plan: ShardingPlan):
    """Place an existing param tree (host or device arrays) into `plan`'s at-rest layout
    (host memory too, when the plan offloads params)."""
    return jax.device_put(params, plan.params)
