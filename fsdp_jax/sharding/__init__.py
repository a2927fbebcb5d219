"""How each leaf shards: mesh axes and logical names, the rules table, strategies, and the
memory policies (precision, remat, host offload). Decisions are data (`LeafSharding`, `Why`).

    axes          names of mesh axes and logical dims, in one place
    mesh          the (data, fsdp, tensor) device mesh (`make_mesh`)
    rule_table    the default rules table and `merge_rules` (data, no JAX)
    thresholds    the size thresholds of the decisions (data, no JAX)
    rules         logical-axis rules + the fallback rule -> a leaf's spec (`explain`)
    leaf_sharding one leaf's decision as a row; reasons: why, as data and prose
    replication   the replicated-bytes guard (`check_sufficiently_sharded`)
    flax_names    logical names read from Flax metadata
    strategy      ZeRO-3/2/1, DDP and HSDP as rows of a table (`STRATEGIES`, `make_plan`)
    precision     the mixed-precision policy (`Policy`); precision_names: its text (data, no JAX)
    remat         activation checkpointing policies, one record each (`REMAT_POLICIES`);
                  remat_names: their names (data, no JAX)
    offload       host memory kinds for optimizer state and master weights (`OFFLOADS`);
                  offload_settings: the `offload:` settings, host and disk (data, no JAX)
"""

from typing import TYPE_CHECKING

from fsdp_jax.lazy_face import lazy_face

if TYPE_CHECKING:  # what static tools see; at run time each name loads on first use
    from fsdp_jax.sharding.mesh import make_mesh
    from fsdp_jax.sharding.offload_settings import OFFLOADS
    from fsdp_jax.sharding.precision import Policy, cast_params_for_compute
    from fsdp_jax.sharding.remat import REMAT_POLICIES, RematPolicy, get_policy, with_remat
    from fsdp_jax.sharding.rule_table import DEFAULT_RULES, merge_rules
    from fsdp_jax.sharding.rules import explain, logical_to_spec
    from fsdp_jax.sharding.strategy import STRATEGIES, ShardingPlan, Strategy, get_strategy, make_plan
    from fsdp_jax.sharding.strategy_names import ALIASES
    from fsdp_jax.sharding.thresholds import DEFAULT_MIN_SHARD_SIZE

# module -> the names of the face it defines (loaded on first use: `fsdp_jax.lazy_face`)
_FACE: dict[str, tuple[str, ...]] = {
    "fsdp_jax.sharding.mesh": ("make_mesh",),
    "fsdp_jax.sharding.offload_settings": ("OFFLOADS",),
    "fsdp_jax.sharding.precision": ("Policy", "cast_params_for_compute"),
    "fsdp_jax.sharding.remat": ("REMAT_POLICIES", "RematPolicy", "get_policy", "with_remat"),
    "fsdp_jax.sharding.rule_table": ("DEFAULT_RULES", "merge_rules"),
    "fsdp_jax.sharding.rules": ("explain", "logical_to_spec"),
    "fsdp_jax.sharding.strategy_names": ("ALIASES",),
    "fsdp_jax.sharding.strategy": ("STRATEGIES", "ShardingPlan", "Strategy", "get_strategy", "make_plan"),
    "fsdp_jax.sharding.thresholds": ("DEFAULT_MIN_SHARD_SIZE",),
}
__getattr__, __dir__ = lazy_face(__name__, _FACE)

__all__ = [
    "ALIASES",
    "DEFAULT_MIN_SHARD_SIZE",
    "DEFAULT_RULES",
    "OFFLOADS",
    "Policy",
    "REMAT_POLICIES",
    "RematPolicy",
    "STRATEGIES",
    "ShardingPlan",
    "Strategy",
    "cast_params_for_compute",
    "explain",
    "get_policy",
    "get_strategy",
    "logical_to_spec",
    "make_mesh",
    "make_plan",
    "merge_rules",
    "with_remat",
]
