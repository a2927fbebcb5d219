"""fsdp_jax: Fully Sharded Data Parallel (ZeRO-3 and relatives) for JAX and Flax."""

import importlib

from fsdp_jax.errors import (
    BatchError,
    MeshError,
    OffloadError,
    ShardingError,
    StateError,
    UnknownNamesWarning,
    VerifyError,
)
from fsdp_jax.model.fns import ModelFns, from_linen, from_nnx
from fsdp_jax.model.lora import LoraModel, with_lora
from fsdp_jax.sharding import axes, rules
from fsdp_jax.sharding.flax_names import logical_axes_of
from fsdp_jax.sharding.leaf_sharding import LeafSharding
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.offload import OFFLOADS
from fsdp_jax.sharding.precision import Policy, cast_params_for_compute
from fsdp_jax.sharding.reasons import Note, Why
from fsdp_jax.sharding.remat import REMAT_POLICIES, RematPolicy, get_policy, with_remat
from fsdp_jax.sharding.replication import check_sufficiently_sharded
from fsdp_jax.sharding.rules import DEFAULT_MIN_SHARD_SIZE, DEFAULT_RULES, explain, logical_to_spec, merge_rules
from fsdp_jax.sharding.strategy import ALIASES, STRATEGIES, ShardingPlan, Strategy, get_strategy, make_plan
from fsdp_jax.train.build import Built, build, init_train_state
from fsdp_jax.train.shard_model import ShardedModel, shard_model
from fsdp_jax.train.state import TrainState, abstract_state, shard_params, state_shardings
from fsdp_jax.train.step import CompiledStep, make_eval_step, make_train_step, sharding_context
from fsdp_jax.train.step_parts import TokenSum
from fsdp_jax.train.trainable import trainable_leaves
from fsdp_jax.verify.report import TOLERANCES, Divergence, StrategyReport, Tolerance, VerifyReport
from fsdp_jax.verify.run import verify

__all__ = [
    "Built",
    "build",
    "axes",
    "rules",
    "checkpoint",
    "ModelFns",
    "ShardedModel",
    "from_linen",
    "from_nnx",
    "LoraModel",
    "with_lora",
    "shard_model",
    "trainable_leaves",
    "MeshError",
    "make_mesh",
    "Policy",
    "cast_params_for_compute",
    "REMAT_POLICIES",
    "RematPolicy",
    "get_policy",
    "with_remat",
    "DEFAULT_MIN_SHARD_SIZE",
    "DEFAULT_RULES",
    "LeafSharding",
    "ShardingError",
    "UnknownNamesWarning",
    "Note",
    "Why",
    "merge_rules",
    "check_sufficiently_sharded",
    "explain",
    "logical_axes_of",
    "logical_to_spec",
    "TrainState",
    "abstract_state",
    "init_train_state",
    "shard_params",
    "state_shardings",
    "BatchError",
    "CompiledStep",
    "TokenSum",
    "make_eval_step",
    "make_train_step",
    "sharding_context",
    "ALIASES",
    "STRATEGIES",
    "ShardingPlan",
    "Strategy",
    "get_strategy",
    "make_plan",
    "verify",
    "VerifyReport",
    "StrategyReport",
    "Divergence",
    "Tolerance",
    "TOLERANCES",
    "VerifyError",
    "StateError",
    "OFFLOADS",
    "OffloadError",
    "targets",
    "hlo",
]
__version__ = "0.1.0"


_LAZY = {"checkpoint", "targets", "hlo"}  # heavy (orbax, tensorstore) or rarely used: loaded on first use


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"fsdp_jax.{name}")
    raise AttributeError(f"module 'fsdp_jax' has no attribute {name!r}")
