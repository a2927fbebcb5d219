"""FSDP for any Flax or JAX project: one call turns a model and an optax optimizer
into a sharded TrainState, its ShardingPlan and a jitted train step.

`shard_model(model, optimizer, mesh, strategy, rng=...)` takes the model as

| `model`                                         | params your loss receives        | logical names from      |
|-------------------------------------------------|----------------------------------|-------------------------|
| `from_nnx(lambda rngs: MyModule(..., rngs=rngs))` | pure dict of the `nnx.Param`s    | `nnx.with_partitioning` |
| `from_linen(module, example_input)`             | the unboxed `"params"` collection | `nn.with_logical_partitioning` |
| an init function `rng -> params`                | what it returns, unboxed (an NNX `State` becomes its pure dict) | the boxes it returns, if any |
| an `nnx.Module` instance                        | pure dict of its `nnx.Param`s    | `nnx.with_partitioning` |
| a params tree (Linen variables, NNX `State`, dict/list/tuple/NamedTuple of arrays) | the same tree, unboxed | the boxes, if any |

The first three are initialised directly in their sharded layout (`jax.eval_shape`
-> plan -> `jit(init, out_shardings=...)`): the full model never lands on one
device. The last two are already materialised and are placed onto the plan's
shardings. Leaves without logical names use the fallback rule
(`fsdp_jax.sharding.rules`); names the rules table does not know fall back too, planning
warns once naming them (`rules.UnknownNamesWarning`), and `ShardedModel.explain()`
says so per leaf. Fewer names than dims leave the trailing dims unsharded.

Flax NNX modules are split into a graph definition and a pure-dict param tree
(portable: checkpoints, safetensors export and optax see plain nested dicts);
`nnx.merge(graphdef, params)` accepts it.

Models with non-trainable state (Linen collections such as `batch_stats`, NNX
`BatchStat` or any other non-Param `Variable`) carry it in `TrainState.model_state`,
and their `apply(params, *args, state=, rng=, train=)` returns `(out, new_state)`;
NNX `Rngs` are split out and re-seeded from the step's key (`fsdp_jax.model.variables`,
docs/stateful_models.md).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import optax
from flax import nnx
from flax.nnx import traversals
from jax.sharding import Mesh

from fsdp_jax.errors import StateError
from fsdp_jax.hlo.memory import tree_bytes_per_device
from fsdp_jax.model.fns import ModelFns, adapt_model
from fsdp_jax.model.lora import LoraModel
from fsdp_jax.model.variables import rows_lines
from fsdp_jax.sharding.leaf_sharding import spec_str
from fsdp_jax.sharding.replication import format_summary, summarize
from fsdp_jax.sharding.rule_table import Rules
from fsdp_jax.sharding.strategy import ShardingPlan, Strategy
from fsdp_jax.sharding.thresholds import (
    DEFAULT_MAX_REPLICATED_FRACTION,
    DEFAULT_MIN_REPLICATED_BYTES,
    DEFAULT_MIN_SHARD_SIZE,
)
from fsdp_jax.train.build import build
from fsdp_jax.train.state import TrainState
from fsdp_jax.train.step import CompiledStep, make_eval_step, make_train_step
from fsdp_jax.train.step_parts import LossFn
from fsdp_jax.train.trainable import trainable_leaves


@dataclasses.dataclass(frozen=True)
class ShardedModel:
    """What `shard_model` returns.

    `state`: the initial TrainState (step 0) in the plan's layout; the first train
    step donates it, so keep the state each step returns. `plan`: shardings of
    params, grads, optimizer state and batch, with `plan.rows` explaining each
    param. `model`: the adapted model (`apply`, `bind` for NNX, `logical_axes`).
    `trainable`: a bool tree matching params (None: everything trains).
    """

    state: TrainState
    plan: ShardingPlan
    optimizer: optax.GradientTransformation
    model: ModelFns
    trainable: Any = None
    precision: Any = None
    rng: Any = None

    @property
    def _extended(self) -> bool:
        """Whether the loss takes the extended call (`fsdp_jax.model.variables`)."""
        return self.plan.model_state is not None or self.model.needs_rng

    @property
    def apply(self) -> Callable[..., Any] | None:
        """`apply(params, *inputs)`: the model's forward on a params tree (None for a
        model given as a bare init function or params tree: apply it yourself)."""
        return self.model.apply

    @property
    def bind(self) -> Callable[[Any], Any] | None:
        """NNX only: `bind(params) -> nnx.Module` holding `params`."""
        return self.model.bind

    def train_step(self, loss_fn: LossFn, **kwargs) -> CompiledStep:
        """`make_train_step(loss_fn, optimizer, plan, trainable=..., **kwargs)`:
        a jitted, donating `step(state, batch) -> (state, metrics)`. `loss_fn(params,
        batch)` gets the params tree in the compute dtype; kwargs: microbatches,
        clip_norm, precision, remat, has_aux, skip_nonfinite, donate, rng.

        A model with state or its own RNG streams (NNX `Rngs`) takes the extended call
        `loss_fn(params, batch, state=, rng=, train=)` and returns `(loss, new_state)`
        when it has state (`fsdp_jax.model.variables`); its run key `rng` defaults to the
        `rng` given to `shard_model`."""
        kwargs.setdefault("trainable", self.trainable)
        kwargs.setdefault("precision", self.precision)
        if self._extended and kwargs.get("rng") is None:
            if self.rng is None and self.model.needs_rng:
                raise StateError(
                    "train_step: the model draws random numbers (NNX Rngs) "
                    "but has no run key; pass train_step(loss_fn, rng=jax.random.key(seed))"
                )
            kwargs["rng"] = self.rng
        return make_train_step(loss_fn, self.optimizer, self.plan, **kwargs)

    def eval_step(self, loss_fn: LossFn, **kwargs) -> CompiledStep:
        """`make_eval_step(loss_fn, plan, **kwargs)`: `eval_step(params, batch) -> {"loss"}`
        (`eval_step(params, model_state, batch)` for a model with state), deterministic."""
        kwargs.setdefault("precision", self.precision)
        kwargs.setdefault("extended", self._extended)
        return make_eval_step(loss_fn, self.plan, **kwargs)

    def bytes_per_device(self, state: TrainState | None = None) -> dict[str, int]:
        """Bytes one device holds of `state` (default: the initial state; shapes and
        shardings only, so a donated state works too): params, opt_state, total."""
        s = self.state if state is None else state
        out = {"params": tree_bytes_per_device(s.params), "opt_state": tree_bytes_per_device(s.opt_state)}
        if s.model_state is not None:
            out["model_state"] = tree_bytes_per_device(s.model_state)
        out["total"] = sum(out.values()) + tree_bytes_per_device(s.step)
        return out

    def explain(self) -> str:
        """One line per param: path, shape, spec, bytes per device, and why
        (logical names, fallback rule, names not in the rules table, threshold);
        `(frozen)` marks params that get no grads; the model state's leaves follow,
        `state:`-prefixed, with the same reasons. A last line sums it up: param
        bytes per device and the fraction replicated over the shard axes."""
        keep = [True] * len(self.plan.rows) if self.trainable is None else jax.tree.leaves(self.trainable)
        width = max((len(r.path) for r in self.plan.rows), default=0)
        lines = [
            f"{r.path:<{width}}  {str(r.shape):<16} {spec_str(r.spec):<28} "
            f"{r.bytes_per_device:>10} B/device  {r.reason}{'' if k else ' (frozen)'}"
            for r, k in zip(self.plan.rows, keep)
        ]
        summary = summarize(self.plan.rows, self.plan.strategy.params or self.plan.strategy.opt_state, self.plan.mesh)
        return "\n".join(lines + rows_lines(self.plan.state_rows) + [format_summary(summary)])


def shard_model(
    model: Any,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    strategy: str | Strategy = "full_shard",
    *,
    rng: jax.Array | None = None,
    trainable: Any = None,
    logical_axes: Any = None,
    rules: Rules | None = None,
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    max_replicated_fraction: float | None = DEFAULT_MAX_REPLICATED_FRACTION,
    min_replicated_bytes: int = DEFAULT_MIN_REPLICATED_BYTES,
    precision: Any = None,
) -> ShardedModel:
    """Shard any Flax (NNX or Linen) or plain-pytree model for FSDP training.

    `model`: a `ModelFns` (`from_nnx`, `from_linen`), an init function
    `rng -> params` (both initialised sharded, from `rng`), an `nnx.Module`
    instance, or a materialised params tree (see the module docstring).
    `optimizer`: any optax transformation; its state is sharded like the params.
    `mesh`: a (`data`, `fsdp`, `tensor`) mesh from `fsdp_jax.make_mesh`.
    `strategy`: `full_shard`, `shard_grad_op`, `shard_opt`, `no_shard`, `hybrid_shard`.
    `trainable`: freeze params (LoRA-style fine-tuning): a bool tree matching the
    params (a prefix is broadcast), a callable `params -> bool tree`, or, for NNX
    models, an NNX filter (`nnx.LoRAParam`, `nnx.PathContains("lora")`, ...). Frozen params
    stay sharded and are never differentiated; give them no optimizer state with
    `optax.multi_transform({...: tx, ...: optax.set_to_zero()}, labels)`. A `LoraModel`
    (`fsdp_jax.model.lora.with_lora`) without `trainable` trains its adapters only, under
    `optax.masked(optimizer)` (no optimizer state for the base). With `precision`, frozen
    params rest in its `frozen` dtype (no master copy of what the step never updates).
    `logical_axes`: a tree of logical-name tuples overriding the model's metadata.
    `rules`, `min_shard_size`, `max_replicated_fraction`, `min_replicated_bytes`: as
    in `make_plan`. `precision`: a `Policy` or its string; its `param_dtype` is the
    dtype the master params (and the optimizer state that follows them) are stored
    in, and it is the default precision of `.train_step` / `.eval_step`.

    Returns a ShardedModel: `.state` (TrainState), `.plan` (ShardingPlan),
    `.train_step(loss_fn, ...)`, `.apply`, `.explain()`, `.bytes_per_device()`.
    """
    fns, params, model_state = adapt_model(model, rng)
    if isinstance(fns, LoraModel) and trainable is None:  # with_lora: adapters train, the base is frozen
        trainable, optimizer = fns.trainable, fns.optimizer(optimizer)
    mask = None if trainable is None else _trainable_mask(fns, trainable)
    if params is None and rng is None:
        raise ValueError(
            "shard_model: this model is initialised sharded from an init function; pass rng=jax.random.key(seed)"
        )
    built = build(
        fns,
        optimizer,
        mesh,
        strategy,
        logical_axes=logical_axes,
        rules=rules,
        min_shard_size=min_shard_size,
        max_replicated_fraction=max_replicated_fraction,
        min_replicated_bytes=min_replicated_bytes,
        precision=precision,
        trainable=mask,
    )
    state = built.init_state(rng) if params is None else built.place(params, model_state)
    return ShardedModel(
        state=state,
        plan=built.plan,
        optimizer=optimizer,
        model=built.model,
        trainable=mask,
        precision=precision,
        rng=rng,
    )


_NNX_FILTERS = tuple(
    getattr(nnx.filterlib, n)
    for n in ("All", "Any", "Not", "OfType", "PathContains", "PathIn", "WithTag", "Everything", "Nothing")
)


def _trainable_mask(fns: ModelFns, trainable):
    """`trainable` (bool tree, callable or NNX filter) as a bool tree matching the params."""
    if _is_nnx_filter(trainable):
        if fns.nnx_state is None:
            raise ValueError(
                f"shard_model: trainable={trainable!r} is an NNX filter, which needs an "
                "NNX model (from_nnx or an nnx.Module); pass a bool tree or a "
                "callable params -> bool tree instead"
            )
        trainable = _nnx_filter_mask(fns.nnx_state, trainable)
    keep = trainable_leaves(fns.abstract_params, trainable)
    return jax.tree.unflatten(jax.tree.structure(fns.abstract_params), keep)


def _is_nnx_filter(f) -> bool:
    """A type (`nnx.LoRAParam`) or an `nnx.filterlib` filter object; plain callables
    and bool trees are masks over the params tree instead."""
    return isinstance(f, type) or isinstance(f, _NNX_FILTERS)


def _nnx_filter_mask(abs_state, nnx_filter):
    """Pure-dict bool tree: True where `nnx_filter` matches the Variable."""
    pred = nnx.filterlib.to_predicate(nnx_filter)
    flat = {path: bool(pred(path, v)) for path, v in nnx.to_flat_state(abs_state)}
    return traversals.unflatten_mapping(flat)
