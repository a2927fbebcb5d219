"""Turn a user's model into what the FSDP core takes: an init function, an apply
function over a plain param tree, and the params' logical dim names.

Flax NNX modules are split into a graph definition and a pure-dict param tree
(portable: checkpoints, safetensors export and optax see plain nested dicts).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
from flax import nnx

from fsdp_jax.rules import logical_axes_of


@dataclasses.dataclass(frozen=True)
class ModelFns:
    """init(rng) -> params; apply(params, *args) -> output; logical_axes: a tree of
    name tuples matching params (None leaves where unannotated), or None."""
    init: Callable[[jax.Array], Any]
    apply: Callable[..., Any]
    logical_axes: Any
    abstract_params: Any


def from_nnx(make_module: Callable[[nnx.Rngs], nnx.Module]) -> ModelFns:
    """Adapt `make_module(rngs) -> nnx.Module` whose state is all `nnx.Param`s.

    `nnx.with_partitioning` metadata becomes `logical_axes`. The module is never
    built concretely here: shapes come from `nnx.eval_shape`.
    """
    with nnx.use_eager_sharding(False):
        abstract = nnx.eval_shape(lambda: make_module(nnx.Rngs(0)))
    graphdef, abs_state, rest = nnx.split(abstract, nnx.Param, ...)
    if jax.tree.leaves(rest):
        raise ValueError("from_nnx: the module holds non-Param state "
                         f"({', '.join(sorted({type(v).__name__ for v in jax.tree.leaves(rest, is_leaf=lambda x: isinstance(x, nnx.Variable))}))}); "
                         "keep only nnx.Param variables (pass RNGs as call arguments)")
    _, logical_axes = logical_axes_of(abs_state)
    pure_axes = None if logical_axes is None else _to_pure(abs_state, logical_axes)

    def init(rng):
        with nnx.use_eager_sharding(False):
            module = make_module(nnx.Rngs(rng))
        return nnx.split(module, nnx.Param, ...)[1].to_pure_dict()

    def apply(params, *args, **kwargs):
        state = jax.tree.map(lambda x: x, abs_state)
        nnx.replace_by_pure_dict(state, params)
        return nnx.merge(graphdef, state)(*args, **kwargs)

    return ModelFns(init=init, apply=apply, logical_axes=pure_axes,
                    abstract_params=abs_state.to_pure_dict())


def _to_pure(abs_state, axes_state):
    """Pure-dict tree of name tuples in the same nesting as `abs_state.to_pure_dict()`."""
    pure = abs_state.to_pure_dict()
    leaves, treedef = jax.tree.flatten(pure)
    names = jax.tree.leaves(axes_state, is_leaf=lambda x: x is None or isinstance(x, tuple))
    if len(names) != len(leaves):
        return None
    return jax.tree.unflatten(treedef, names)
