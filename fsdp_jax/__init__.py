"""fsdp_jax: Fully Sharded Data Parallel (ZeRO-3 and relatives) for JAX and Flax."""

from fsdp_jax import axes, rules
from fsdp_jax.adapters import ModelFns, ShardedModel, from_linen, from_nnx, shard_model
from fsdp_jax.build import Built, build, init_train_state
from fsdp_jax.mesh import MeshError, make_mesh
from fsdp_jax.model_state import StateError
from fsdp_jax.offload import OFFLOADS, OffloadError
from fsdp_jax.precision import Policy, cast_params_for_compute
from fsdp_jax.remat import REMAT_POLICIES, get_policy, with_remat
from fsdp_jax.rules import (
    DEFAULT_MIN_SHARD_SIZE,
    DEFAULT_RULES,
    LeafSharding,
    Note,
    ShardingError,
    UnknownNamesWarning,
    Why,
    check_sufficiently_sharded,
    explain,
    logical_axes_of,
    logical_to_spec,
    merge_rules,
)
from fsdp_jax.state import TrainState, abstract_state, shard_params, state_shardings
from fsdp_jax.step import (
    BatchError,
    CompiledStep,
    TokenSum,
    make_eval_step,
    make_train_step,
    sharding_context,
    trainable_leaves,
)
from fsdp_jax.strategy import ALIASES, STRATEGIES, ShardingPlan, Strategy, get_strategy, make_plan
from fsdp_jax.verify import VerifyError, verify
from fsdp_jax.verify_report import TOLERANCES, Divergence, StrategyReport, Tolerance, VerifyReport

__all__ = [
    "Built",
    "build",
    "axes",
    "rules",
    "checkpoint",
    "memory",
    "ModelFns",
    "ShardedModel",
    "from_linen",
    "from_nnx",
    "shard_model",
    "trainable_leaves",
    "MeshError",
    "make_mesh",
    "Policy",
    "cast_params_for_compute",
    "REMAT_POLICIES",
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


_LAZY = {"checkpoint", "memory", "targets", "hlo"}  # heavy (orbax, tensorstore) or rarely used: loaded on first use


def __getattr__(name):
    if name in _LAZY:
        import importlib

        return importlib.import_module(f"fsdp_jax.{name}")
    raise AttributeError(f"module 'fsdp_jax' has no attribute {name!r}")
