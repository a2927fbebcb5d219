"""Sharding strategies as data: which mesh axes shard params, grads and optimizer state.

| strategy          | params at rest | params in compute       | grads        | optimizer state |
|-------------------|----------------|-------------------------|--------------|-----------------|
| full_shard (ZeRO-3)   | data x fsdp | gathered per layer by XLA | data x fsdp | data x fsdp |
| shard_grad_op (ZeRO-2)| data x fsdp | gathered once per step  | data x fsdp  | data x fsdp     |
| shard_opt (ZeRO-1)    | replicated  | replicated              | replicated   | data x fsdp     |
| no_shard (DDP)        | replicated  | replicated              | replicated   | replicated      |
| hybrid_shard (HSDP)   | fsdp        | gathered per layer      | fsdp         | fsdp            |

"Replicated" means replicated over the `data` and `fsdp` axes; `tensor` rules from
the table still apply (FSDP x TP). `full_shard` shards over every data-parallel
device, as PyTorch FSDP's FULL_SHARD does; `hybrid_shard` shards within `fsdp` and
replicates over `data` (one replica per host / DCN slice).

This module takes plain arguments and any pytree: no model, config or trainer.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.sharding import axes
from fsdp_jax.sharding.leaf_sharding import LeafSharding
from fsdp_jax.sharding.offload import at_rest, check_supported
from fsdp_jax.sharding.replication import check_sufficiently_sharded
from fsdp_jax.sharding.rule_table import DEFAULT_RULES, Rules, merge_rules
from fsdp_jax.sharding.rules import explain, plan_leaf, specs_from_rows, warn_unknown_names
from fsdp_jax.sharding.strategy_names import ALIASES
from fsdp_jax.sharding.thresholds import (
    DEFAULT_MAX_REPLICATED_FRACTION,
    DEFAULT_MIN_REPLICATED_BYTES,
    DEFAULT_MIN_SHARD_SIZE,
)


@dataclasses.dataclass(frozen=True)
class Strategy:
    """Which mesh axes shard each kind of state. `gather_once` keeps params gathered
    for the whole step (ZeRO-2) instead of letting XLA gather per layer."""

    name: str
    params: tuple[str, ...]
    grads: tuple[str, ...]
    opt_state: tuple[str, ...]
    gather_once: bool = False
    description: str = ""


_DP = (axes.DATA, axes.FSDP, axes.CONTEXT)  # context ranks share a batch shard: ZeRO over them too
STRATEGIES: dict[str, Strategy] = {
    s.name: s
    for s in (
        Strategy("full_shard", _DP, _DP, _DP, description="ZeRO-3: params, grads and optimizer state sharded"),
        Strategy(
            "shard_grad_op",
            _DP,
            _DP,
            _DP,
            gather_once=True,
            description="ZeRO-2: params gathered once per step, grads and optimizer state sharded",
        ),
        Strategy("shard_opt", (), (), _DP, description="ZeRO-1: optimizer state sharded"),
        Strategy("no_shard", (), (), (), description="DDP: everything replicated"),
        Strategy(
            "hybrid_shard",
            (axes.FSDP, axes.CONTEXT),
            (axes.FSDP, axes.CONTEXT),
            (axes.FSDP, axes.CONTEXT),
            description="HSDP: sharded within fsdp, replicated over data",
        ),
    )
}


def get_strategy(name: str | Strategy) -> Strategy:
    """Look up a strategy by name or alias; unknown names raise ValueError listing the choices."""
    if isinstance(name, Strategy):
        return name
    key = ALIASES.get(str(name).lower(), str(name).lower())
    if key not in STRATEGIES:
        raise ValueError(
            f"unknown strategy {name!r}; choose one of {', '.join(STRATEGIES)} (aliases: {', '.join(ALIASES)})"
        )
    return STRATEGIES[key]


@dataclasses.dataclass(frozen=True)
class ShardingPlan:
    """NamedSharding trees for one strategy on one mesh.

    `params` is the layout at rest (and in the train state), `compute` the layout
    the forward pass starts from, `grads` where gradients are reduced to,
    `opt_state` the optimizer state, `batch` the leading batch dim of inputs.
    `rows` explain each parameter's at-rest spec. `layered` (None without logical
    names) marks the leaves stacked over scanned layers: a model that gathers its
    layers itself (`fsdp_jax.train.layer_gather`) casts and gathers those inside its layer
    loop (ZeRO-2 then keeps them at rest until the loop). `offload` names which of params /
    opt_state rest in host memory (their shardings then carry memory kind
    `pinned_host`; `fsdp_jax.sharding.offload`). `model_state`: shardings of the model's
    non-trainable variables (None when it has none), laid out like params at rest
    (same rules, same shard axes; always on the device); `state_rows` explain them.
    """

    strategy: Strategy
    mesh: Mesh
    params: Any
    compute: Any
    grads: Any
    opt_state: Any
    batch: NamedSharding
    rows: tuple[LeafSharding, ...]
    rules: Any
    offload: str = "none"
    model_state: Any = None
    state_rows: tuple[LeafSharding, ...] = ()
    layered: Any = None  # tree of bools: leaf stacked over scanned layers (logical `layers`)

    def replicated(self) -> NamedSharding:
        return NamedSharding(self.mesh, P())


def _named(mesh: Mesh, specs):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def opt_state_shardings(
    optimizer: optax.GradientTransformation,
    abstract_params,
    param_specs,
    mesh: Mesh,
    shard_axes: Sequence[str],
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
):
    """NamedShardings for `optimizer`'s state, derived from the params' specs.

    Param-shaped state (Adam moments, momentum) reuses the param spec via
    `optax.tree_utils.tree_map_params`; state of another shape (Adafactor's
    factored rows/cols) gets the fallback rule; scalars (counts) stay replicated.
    """
    abstract_state = jax.eval_shape(optimizer.init, abstract_params)

    def for_param(leaf, p_and_spec):
        if isinstance(leaf, optax.MaskedNode):  # frozen by optax.masked: no state
            return leaf
        p, spec = p_and_spec
        if tuple(np.shape(leaf)) == tuple(p.shape):
            return spec
        row, _ = plan_leaf("", np.shape(leaf), leaf.dtype, None, mesh, None, shard_axes, min_shard_size)
        return row.spec

    def non_param(leaf):
        if not hasattr(leaf, "shape"):
            return leaf
        row, _ = plan_leaf("", np.shape(leaf), leaf.dtype, None, mesh, None, shard_axes, min_shard_size)
        return row.spec

    paired = jax.tree.map(lambda p, s: (p, s), abstract_params, param_specs, is_leaf=lambda x: isinstance(x, P))
    specs = optax.tree_utils.tree_map_params(
        optimizer,
        for_param,
        abstract_state,
        paired,
        transform_non_params=non_param,
        is_leaf=lambda x: (
            isinstance(x, optax.MaskedNode) or (isinstance(x, tuple) and len(x) == 2 and isinstance(x[1], P))
        ),
    )
    return _named(mesh, specs)


def make_plan(
    abstract_params,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    strategy: str | Strategy = "full_shard",
    logical_axes=None,
    rules: Rules | None = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    max_replicated_fraction: float | None = DEFAULT_MAX_REPLICATED_FRACTION,
    min_replicated_bytes: int = DEFAULT_MIN_REPLICATED_BYTES,
    offload: str = "none",
    abstract_model_state=None,
    model_state_axes=None,
) -> ShardingPlan:
    """Shardings of params (at rest and in compute), grads and optimizer state.

    `abstract_params`: a tree of arrays or ShapeDtypeStructs. `logical_axes`: a
    matching tree of logical-name tuples (None for unannotated leaves), or None.
    `rules`: logical name -> mesh axes (default `rules.DEFAULT_RULES`; merge your
    changes over it). Under a strategy that shards params, fails when more than
    `max_replicated_fraction` of parameter bytes stay replicated (None: no check),
    unless the replicated bytes are under `min_replicated_bytes` (then it warns).
    Warns once (UnknownNamesWarning) when logical names are not in `rules`.
    `offload` ("none" | "optimizer" | "optimizer+params"): which state rests in host
    memory; raises `fsdp_jax.sharding.offload.OffloadError` where the backend has none.
    `abstract_model_state` (with `model_state_axes`, names as for params): the model's
    non-trainable variables, sharded like params at rest by the same rules (small
    leaves replicated); None for a model without them.
    """
    s = get_strategy(strategy)
    off = check_supported(offload, mesh.devices.flat)
    rules = _resolved_rules(rules, mesh)

    def rows(shard_axes):
        return explain(abstract_params, mesh, logical_axes, rules, shard_axes, min_shard_size)

    cache: dict[tuple[str, ...], list[LeafSharding]] = {}
    for axes_ in {s.params, s.grads, s.opt_state, ()}:
        cache[axes_] = rows(axes_)
    specs = {k: specs_from_rows(abstract_params, v) for k, v in cache.items()}
    warn_unknown_names(cache[()], mesh)
    if s.params and max_replicated_fraction is not None:
        check_sufficiently_sharded(cache[s.params], s.params, mesh, max_replicated_fraction, min_replicated_bytes)
    compute = specs[()] if s.gather_once else specs[s.params]
    batch_axes = tuple(a for a in (axes.DATA, axes.FSDP) if a in mesh.shape)
    params, opt_state = at_rest(
        _named(mesh, specs[s.params]),
        opt_state_shardings(optimizer, abstract_params, specs[s.opt_state], mesh, s.opt_state, min_shard_size),
        off,
    )
    state_rows, state_sh = _model_state_shardings(
        abstract_model_state, model_state_axes, mesh, rules, s.params, min_shard_size
    )
    return ShardingPlan(
        strategy=s,
        mesh=mesh,
        params=params,
        compute=_named(mesh, compute),
        grads=_named(mesh, specs[s.grads]),
        opt_state=opt_state,
        batch=NamedSharding(mesh, P(batch_axes)),
        rows=tuple(cache[s.params]),
        rules=rules,
        offload=off.name,
        model_state=state_sh,
        state_rows=state_rows,
        layered=_layered(logical_axes),
    )


def _resolved_rules(rules: Rules | None, mesh: Mesh) -> Rules:
    """`rules` validated against the mesh's axes, and lists (from YAML) as tuples, the form
    Flax's logical_axis_rules takes; the default table for None."""
    if rules is None:
        return DEFAULT_RULES
    return merge_rules(rules, {}, mesh_axes=tuple(dict.fromkeys(axes.MESH_AXES + tuple(mesh.axis_names))))


def _model_state_shardings(abstract_model_state, model_state_axes, mesh: Mesh, rules, shard_axes, min_shard_size):
    """(rows, shardings) of the model's non-trainable state, sharded like params at rest by
    the same rules (a leaf no dim of which divides the shard group stays replicated instead
    of failing); ((), None) without model state."""
    if abstract_model_state is None:
        return (), None
    state_rows = tuple(
        explain(abstract_model_state, mesh, model_state_axes, rules, shard_axes, min_shard_size, allow_unshardable=True)
    )
    return state_rows, _named(mesh, specs_from_rows(abstract_model_state, state_rows))


def _layered(logical_axes):
    """Per param, whether it is stacked over layers (its names hold `layers`); None
    without logical names."""
    if logical_axes is None:
        return None
    return jax.tree.map(
        lambda n: bool(n) and axes.LAYERS in n, logical_axes, is_leaf=lambda x: x is None or isinstance(x, tuple)
    )


def batch_divisor(mesh: Mesh) -> int:
    """The global batch must be a multiple of this (data x fsdp)."""
    return mesh.shape.get(axes.DATA, 1) * mesh.shape.get(axes.FSDP, 1)
