"""fsdp_jax: Fully Sharded Data Parallel (ZeRO-3 and relatives) for JAX and Flax."""

from fsdp_jax import axes, checkpoint, memory, planner
from fsdp_jax.adapters import ModelFns, ShardedModel, from_linen, from_nnx, shard_model
from fsdp_jax.mesh import MeshError, make_mesh
from fsdp_jax.precision import Policy, cast_params_for_compute
from fsdp_jax.remat import REMAT_POLICIES, get_policy, with_remat
from fsdp_jax.rules import (DEFAULT_MIN_SHARD_SIZE, DEFAULT_RULES, LeafSharding, ShardingError,
                            check_sufficiently_sharded, explain, logical_axes_of, logical_to_spec)
from fsdp_jax.state import TrainState, abstract_state, init_train_state, shard_params, state_shardings
from fsdp_jax.step import (BatchError, CompiledStep, make_eval_step, make_train_step, sharding_context,
                           trainable_leaves)
from fsdp_jax.strategy import ALIASES, STRATEGIES, ShardingPlan, Strategy, get_strategy, make_plan

__all__ = [
    "axes", "checkpoint", "memory", "planner", "ModelFns", "ShardedModel", "from_linen", "from_nnx", "shard_model", "trainable_leaves", "MeshError", "make_mesh", "Policy", "cast_params_for_compute", "REMAT_POLICIES",
    "get_policy", "with_remat", "DEFAULT_MIN_SHARD_SIZE", "DEFAULT_RULES", "LeafSharding",
    "ShardingError", "check_sufficiently_sharded", "explain", "logical_axes_of",
    "logical_to_spec", "TrainState", "abstract_state", "init_train_state", "shard_params",
    "state_shardings", "BatchError", "CompiledStep", "make_eval_step", "make_train_step",
    "sharding_context", "ALIASES", "STRATEGIES", "ShardingPlan", "Strategy", "get_strategy",
    "make_plan",
]
__version__ = "0.1.0"
