"""Train state, abstract shapes and sharded initialisation.

The full model never lands on one device: `jax.eval_shape` gives shapes,
`fsdp_jax.sharding.strategy.make_plan` gives shardings, and `jax.jit(init,
out_shardings=...)` materialises each shard where it lives.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.sharding.strategy import ShardingPlan


@dataclasses.dataclass(frozen=True)
class TrainState:
    """step: int32 scalar (replicated); params: master weights; opt_state: optax state;
    model_state: the model's non-trainable variables (Linen `batch_stats`, NNX
    `BatchStat`, ...; `fsdp_jax.model.variables`), None for a model without them.

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
    return TrainState(
        step=NamedSharding(plan.mesh, P()), params=plan.params, opt_state=plan.opt_state, model_state=plan.model_state
    )


def abstract_state(plan: ShardingPlan, abstract_params, optimizer, abstract_model_state=None) -> TrainState:
    """TrainState of ShapeDtypeStructs carrying `plan`'s shardings (nothing allocated);
    the target tree for AOT compilation and for checkpoint restore."""
    opt = jax.eval_shape(optimizer.init, abstract_params)
    shapes = TrainState(
        step=jax.ShapeDtypeStruct((), jnp.int32),
        params=abstract_params,
        opt_state=opt,
        model_state=abstract_model_state,
    )
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, state_shardings(plan))


def shard_params(params, plan: ShardingPlan):
    """Place an existing param tree (host or device arrays) into `plan`'s at-rest layout
    (host memory too, when the plan offloads params)."""
    return jax.device_put(params, plan.params)
