"""A model as functions (`ModelFns`), and the adapters that make one from a Flax NNX
module (`from_nnx`), a Linen module (`from_linen`), an init function, an NNX module
instance or a materialised params tree (`adapt`). What each form gives the loss:
the table in `fsdp_jax.train.shard_model`, whose `shard_model` takes any of them.

`build` and `init_train_state` take a `ModelFns`; this module imports neither, so the
library's import graph has no cycle (adapters -> build -> model_fns).
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from flax.core import meta, unfreeze

from fsdp_jax.errors import StateError
from fsdp_jax.model.nnx_split import NnxSplit, abstract_of, pure_names
from fsdp_jax.sharding import rules
from fsdp_jax.sharding.flax_names import logical_axes_of


@dataclasses.dataclass(frozen=True)
class ModelFns:
    """init(rng) -> params; apply(params, *args) -> output; logical_axes: a tree of
    name tuples matching params (None leaves where unannotated), or None.

    NNX models also carry `bind(params) -> nnx.Module` and `nnx_state`, the
    abstract `nnx.State` (Variable types, for NNX filters such as
    `trainable=nnx.LoRAParam`). `init` is None for already materialised params,
    `apply` None where the caller applies the params itself.

    Models with non-trainable state: `abstract_model_state` (its shapes, a pure tree),
    `model_state_axes` (logical names or None), `init_state(rng) -> state`; their
    `apply(params, *args, state=, rng=, train=True)` returns `(out, new_state)`.
    `needs_rng`: the model draws random numbers from its own streams (NNX `Rngs`), so
    the train step must be given a run key."""

    init: Callable[[jax.Array], Any] | None
    apply: Callable[..., Any] | None
    logical_axes: Any
    abstract_params: Any
    bind: Callable[..., Any] | None = None
    nnx_state: Any = None
    abstract_model_state: Any = None
    model_state_axes: Any = None
    init_state: Callable[[jax.Array], Any] | None = None
    needs_rng: bool = False


def from_nnx(make_module: Callable[[nnx.Rngs], nnx.Module]) -> ModelFns:
    """Adapt `make_module(rngs) -> nnx.Module`.

    `nnx.Param`s are trained; every other `Variable` (`BatchStat`, ...) is model state
    (`TrainState.model_state`); `nnx.Rngs` state is not carried but re-seeded each
    step from the step's key. `nnx.with_partitioning` metadata becomes
    `logical_axes`. The module is never built concretely here: shapes come from
    `nnx.eval_shape`.
    """
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: make_module(nnx.Rngs(0)))
    parts = NnxSplit(*nnx.split(abstract, nnx.Param, nnx.RngState, ...))

    def init(rng):
        with nnx.use_eager_sharding(False):
            module = make_module(nnx.Rngs(rng))
        return nnx.to_pure_dict(nnx.split(module, nnx.Param, ...)[1])

    def init_state(rng):
        with nnx.use_eager_sharding(False):
            module = make_module(nnx.Rngs(rng))
        return nnx.to_pure_dict(nnx.split(module, nnx.Param, nnx.RngState, ...)[3])

    return ModelFns(**parts.fns_fields(init, init_state))


def from_linen(
    module: nn.Module,
    *example_args,
    state: tuple[str, ...] = ("batch_stats",),
    rngs: tuple[str, ...] = ("dropout",),
    axis_names: tuple[str, ...] = (),
    **example_kwargs,
) -> ModelFns:
    """Adapt a Linen `module` initialised by `module.init(rng, *example_args,
    **example_kwargs)`; the `"params"` collection is trained.

    `state`: the collections carried as model state (`TrainState.model_state`,
    updated by each train step as `mutable=state`); a collection the module creates
    that is neither `params` nor declared here is a `StateError` naming it. `rngs`:
    the RNG streams the model draws from (each gets its own key from the step's).
    Example inputs may be arrays or `jax.ShapeDtypeStruct`s (only shapes matter).
    `nn.with_logical_partitioning` metadata becomes `logical_axes`; params are
    unboxed. `apply(params, *args, state=None, rng=None, train=True, **kwargs)` is
    `module.apply({"params": params, **state}, ...)`: with model state it returns
    `(out, new_state)` (the state unchanged when not `train`); `train` is also passed
    to the module when its `__call__` takes `train` (and `deterministic=not train`
    when it takes `deterministic`); `rng` feeds the `rngs` streams when training.
    `axis_names`: collective axis names the module uses for pmap-style data
    parallelism (Flax's ImageNet ResNet: `BatchNorm(axis_name="batch")`). Under
    GSPMD a batch mean already spans the global batch, so apply binds each name to
    a size-1 `vmap` axis, over which `pmean` is the identity.
    """
    rngs = tuple(rngs)

    def variables(rng):
        args, kwargs = jax.tree.map(
            lambda a: jnp.zeros(a.shape, a.dtype) if isinstance(a, jax.ShapeDtypeStruct) else a,
            (example_args, example_kwargs),
        )
        return module.init({"params": rng, **_stream_keys(rngs, jax.random.fold_in(rng, 1))}, *args, **kwargs)

    abstract = jax.eval_shape(variables, jax.random.key(0))
    extra = sorted(set(abstract) - {"params"} - set(state))
    if extra:
        raise StateError(
            f"from_linen: {type(module).__name__} creates the collection {extra[0]!r}, which is "
            f"neither trained ('params') nor declared as state (state={tuple(state)!r}); declare "
            f"it: from_linen(module, ..., state={tuple(state) + tuple(extra)!r})"
        )
    cols = tuple(c for c in state if c in abstract)
    values, names = _plain(abstract["params"])
    s_values, s_names = _plain({c: abstract[c] for c in cols}) if cols else (None, None)

    def init(rng):
        return _plain(variables(rng)["params"])[0]

    def init_state(rng):
        v = variables(rng)
        return _plain({c: v[c] for c in cols})[0]

    return ModelFns(
        init=init,
        apply=_linen_apply(module, rngs, cols, axis_names),
        logical_axes=names,
        abstract_params=values,
        abstract_model_state=s_values,
        model_state_axes=s_names,
        init_state=init_state if cols else None,
    )


def _linen_apply(module: nn.Module, rngs: tuple[str, ...], cols: tuple[str, ...], axis_names: tuple[str, ...]):
    """`from_linen`'s `apply(params, *args, state=None, rng=None, train=True, **kwargs)` for
    `module` with model-state collections `cols`, RNG streams `rngs` and pmap-era
    `axis_names` (see `from_linen`)."""
    params_of = inspect.signature(module.__call__).parameters

    def apply(params, *args, **kwargs):
        fn = _apply
        for name in axis_names:  # bind pmap-era axis names; size 1, so pmean is the identity
            fn = _bound(fn, name)
        return fn(params, *args, **kwargs)

    def _apply(params, *args, state=None, rng=None, train=True, **kwargs):
        if "train" in params_of:
            kwargs.setdefault("train", train)
        if "deterministic" in params_of:
            kwargs.setdefault("deterministic", not train)
        streams = _stream_keys(rngs, rng) if train and rng is not None else None
        variables_ = {"params": params, **(state or {})}
        if not cols:
            return module.apply(variables_, *args, rngs=streams, **kwargs)
        if not train:
            return module.apply(variables_, *args, rngs=streams, **kwargs), state
        out, new = module.apply(variables_, *args, rngs=streams, mutable=list(cols), **kwargs)
        return out, {c: unfreeze(new[c]) if c in new else state[c] for c in cols}

    return apply


def _bound(fn, name: str):
    """`fn` run under a size-1 `vmap` axis called `name` (inputs and outputs unchanged)."""

    def run(*args, **kwargs):
        out = jax.vmap(lambda a, k: fn(*a, **k), axis_name=name, axis_size=1, in_axes=None, out_axes=0)(args, kwargs)
        return jax.tree.map(lambda x: x[0], out)

    return run


def _stream_keys(names: tuple[str, ...], rng) -> dict[str, jax.Array]:
    """One key per RNG stream name: `fold_in(rng, i)`."""
    return {n: jax.random.fold_in(rng, i) for i, n in enumerate(names)}


# ----------------------------------------------------------------------------- helpers


def adapt_model(model, rng) -> tuple[ModelFns, Any, Any]:
    """(ModelFns, materialised params or None when `fns.init` builds them, materialised
    model state or None)."""
    if isinstance(model, ModelFns):
        return model, None, None
    if isinstance(model, nnx.Module):
        return _from_nnx_instance(model)
    if isinstance(model, nn.Module):
        raise TypeError(
            f"shard_model: a Linen module ({type(model).__name__}) needs example inputs "
            "to initialise; pass from_linen(module, example_input) or its variables"
        )
    leaves = jax.tree.leaves(model)
    if callable(model) and len(leaves) == 1 and leaves[0] is model:  # a function, not a callable pytree
        return _from_init(model, jax.random.key(0) if rng is None else rng), None, None
    values, names = _plain(model)
    _check_arrays(values)
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), values)
    return ModelFns(init=None, apply=None, logical_axes=names, abstract_params=abstract), values, None


def _from_init(init_fn: Callable[[jax.Array], Any], rng: jax.Array) -> ModelFns:
    """Adapt `init_fn(rng) -> params` (plain, Linen-boxed, or an NNX State)."""
    values, names = _plain(jax.eval_shape(init_fn, rng))
    _check_arrays(values)
    return ModelFns(init=lambda rng: _plain(init_fn(rng))[0], apply=None, logical_axes=names, abstract_params=values)


def _from_nnx_instance(module: nnx.Module) -> tuple[ModelFns, Any, Any]:
    graphdef, state, rng, rest = nnx.split(module, nnx.Param, nnx.RngState, ...)
    parts = NnxSplit(graphdef, abstract_of(state), abstract_of(rng), abstract_of(rest))
    fns = ModelFns(**parts.fns_fields(None, None))
    return fns, nnx.to_pure_dict(state), nnx.to_pure_dict(rest) if parts.stateful else None


def _plain(tree):
    """(values, logical_axes) for a tree that may carry Flax metadata: NNX States
    become pure dicts, Linen boxes are unboxed."""
    values, names = logical_axes_of(tree)
    if isinstance(values, nnx.State):
        names = None if names is None else pure_names(values, names)
        return nnx.to_pure_dict(values), names
    return meta.unbox(values), names


def _check_arrays(tree) -> None:
    for path, x in jax.tree_util.tree_flatten_with_path(tree)[0]:
        if not (hasattr(x, "shape") and hasattr(x, "dtype")):
            raise TypeError(
                f"shard_model: params leaf {rules.path_str(path) or '<root>'} is a "
                f"{type(x).__name__}, not an array; keep only arrays in the params tree "
                "(e.g. equinox: eqx.partition(model, eqx.is_array))"
            )
