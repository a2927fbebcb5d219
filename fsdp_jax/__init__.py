"""fsdp_jax: Fully Sharded Data Parallel (ZeRO-3 and relatives) for JAX and Flax.

The face loads on first use (PEP 562): `import fsdp_jax` imports no JAX, and the first name
read from it imports every module below at once, as an eager face did, so `fsdp_jax.X` and
`from fsdp_jax import X` behave as before. What gains: a process that imports a submodule
without reading the face (the command line refusing a bad flag, `fsdp_jax.errors`) does not
pay for JAX and Flax."""

import importlib
import sys
import types
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # what IDEs and type checkers see (the names of `_FACE`); nothing loads at run time
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
    from fsdp_jax.sharding.offload_settings import OFFLOADS
    from fsdp_jax.sharding.precision import Policy, cast_params_for_compute
    from fsdp_jax.sharding.reasons import Note, Why
    from fsdp_jax.sharding.remat import REMAT_POLICIES, RematPolicy, get_policy, with_remat
    from fsdp_jax.sharding.replication import check_sufficiently_sharded
    from fsdp_jax.sharding.rule_table import DEFAULT_RULES, merge_rules
    from fsdp_jax.sharding.rules import explain, logical_to_spec
    from fsdp_jax.sharding.strategy import STRATEGIES, ShardingPlan, Strategy, get_strategy, make_plan
    from fsdp_jax.sharding.strategy_names import ALIASES
    from fsdp_jax.sharding.thresholds import DEFAULT_MIN_SHARD_SIZE
    from fsdp_jax.train.build import Built, build, init_train_state
    from fsdp_jax.train.shard_model import ShardedModel, shard_model
    from fsdp_jax.train.state import TrainState, abstract_state, shard_params, state_shardings
    from fsdp_jax.train.step import CompiledStep, make_eval_step, make_train_step, sharding_context
    from fsdp_jax.train.step_parts import TokenSum
    from fsdp_jax.train.trainable import trainable_leaves
    from fsdp_jax.verify.report import TOLERANCES, Divergence, StrategyReport, Tolerance, VerifyReport
    from fsdp_jax.verify.run import verify

# module -> the names of the face it defines (read with `from module import name`)
_FACE: dict[str, tuple[str, ...]] = {
    "fsdp_jax.errors": (
        "BatchError",
        "MeshError",
        "OffloadError",
        "ShardingError",
        "StateError",
        "UnknownNamesWarning",
        "VerifyError",
    ),
    "fsdp_jax.model.fns": ("ModelFns", "from_linen", "from_nnx"),
    "fsdp_jax.model.lora": ("LoraModel", "with_lora"),
    "fsdp_jax.sharding": ("axes", "rules"),
    "fsdp_jax.sharding.flax_names": ("logical_axes_of",),
    "fsdp_jax.sharding.leaf_sharding": ("LeafSharding",),
    "fsdp_jax.sharding.mesh": ("make_mesh",),
    "fsdp_jax.sharding.offload_settings": ("OFFLOADS",),
    "fsdp_jax.sharding.precision": ("Policy", "cast_params_for_compute"),
    "fsdp_jax.sharding.reasons": ("Note", "Why"),
    "fsdp_jax.sharding.remat": ("REMAT_POLICIES", "RematPolicy", "get_policy", "with_remat"),
    "fsdp_jax.sharding.replication": ("check_sufficiently_sharded",),
    "fsdp_jax.sharding.rule_table": ("DEFAULT_RULES", "merge_rules"),
    "fsdp_jax.sharding.rules": ("explain", "logical_to_spec"),
    "fsdp_jax.sharding.strategy_names": ("ALIASES",),
    "fsdp_jax.sharding.strategy": ("STRATEGIES", "ShardingPlan", "Strategy", "get_strategy", "make_plan"),
    "fsdp_jax.sharding.thresholds": ("DEFAULT_MIN_SHARD_SIZE",),
    "fsdp_jax.train.build": ("Built", "build", "init_train_state"),
    "fsdp_jax.train.shard_model": ("ShardedModel", "shard_model"),
    "fsdp_jax.train.state": ("TrainState", "abstract_state", "shard_params", "state_shardings"),
    "fsdp_jax.train.step": ("CompiledStep", "make_eval_step", "make_train_step", "sharding_context"),
    "fsdp_jax.train.step_parts": ("TokenSum",),
    "fsdp_jax.train.trainable": ("trainable_leaves",),
    "fsdp_jax.verify.report": ("TOLERANCES", "Divergence", "StrategyReport", "Tolerance", "VerifyReport"),
    "fsdp_jax.verify.run": ("verify",),
}
_LAZY = {"checkpoint", "targets", "hlo"}  # heavy (orbax, tensorstore) or rarely used: loaded on first use

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


def _load_face() -> None:
    """Bind every name of `_FACE` in this module's namespace (the eager face's imports)."""
    names = globals()
    for module, attrs in _FACE.items():
        loaded = importlib.import_module(module)
        names.update({a: _attr(loaded, a) for a in attrs})


def _attr(module: types.ModuleType, name: str):
    """What `from module import name` binds: the attribute, else the submodule of that name
    (a lazy package face, `fsdp_jax.lazy_face`, binds a submodule only once it is imported)."""
    try:
        return getattr(module, name)
    except AttributeError:
        return importlib.import_module(f"{module.__name__}.{name}")


def __getattr__(name):
    if name in _LAZY:
        return importlib.import_module(f"fsdp_jax.{name}")
    if any(name in attrs for attrs in _FACE.values()):
        _load_face()
        return globals()[name]
    raise AttributeError(f"module 'fsdp_jax' has no attribute {name!r}")


def __dir__():
    return sorted({*globals(), *__all__})


class _Face(types.ModuleType):
    """The package's module type: the subpackage `fsdp_jax.verify` shares its name with the
    face's function `verify`, and importing the subpackage binds it here as an attribute.
    The eager face bound the function over it; this keeps that: the subpackage is not bound,
    so `fsdp_jax.verify` is the function (the subpackage stays `sys.modules["fsdp_jax.verify"]`)."""

    def __setattr__(self, name, value):
        if name == "verify" and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Face
