"""An NNX module as the pieces fsdp_jax trains: graph definition, `nnx.Param`s (trained),
`nnx.RngState` (re-seeded from the step's key, never carried) and every other
`Variable` (model state: `BatchStat`, ...), each as a pure dict, and the functions
that put them back together (`bind`, `apply`). Used by `fsdp_jax.train.shard_model`."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from fsdp_jax.sharding.flax_names import logical_axes_of


@dataclasses.dataclass(frozen=True)
class NnxSplit:
    """An NNX module split into graphdef, Params, RngState and the rest (model state)."""

    graphdef: Any
    params: nnx.State
    rng: nnx.State
    rest: nnx.State

    @property
    def stateful(self) -> bool:
        return bool(jax.tree.leaves(self.rest))

    def bind(self, params, state=None, rng=None) -> nnx.Module:
        """The module holding `params`, model `state` (default: the abstract one's
        shapes; pass it for a stateful model) and RNG streams seeded from `rng`."""
        p = jax.tree.map(lambda x: x, self.params)
        nnx.replace_by_pure_dict(p, params)
        rest = jax.tree.map(lambda x: x, self.rest)
        if state is not None:
            nnx.replace_by_pure_dict(rest, state)
        r = jax.tree.map(lambda x: x, self.rng)
        if jax.tree.leaves(r):
            base = jax.random.key(0) if rng is None else rng
            pure = nnx.to_pure_dict(r)
            leaves, treedef = jax.tree.flatten(pure)
            seeded = [
                jax.random.fold_in(base, i)
                if jnp.issubdtype(x.dtype, jax.dtypes.prng_key)
                else jnp.zeros(x.shape, x.dtype)
                for i, x in enumerate(leaves)
            ]
            nnx.replace_by_pure_dict(r, jax.tree.unflatten(treedef, seeded))
        return nnx.merge(self.graphdef, p, r, rest)

    def apply(self, params, *args, state=None, rng=None, train=True, **kwargs):
        module = self.bind(params, state, rng)
        module.train() if train else module.eval()
        out = module(*args, **kwargs)
        if not self.stateful:
            return out
        return out, nnx.to_pure_dict(nnx.split(module, nnx.Param, nnx.RngState, ...)[3])

    def fns_fields(self, init, init_state) -> dict[str, Any]:
        """`fsdp_jax.train.shard_model.ModelFns` fields for this module."""
        _, logical_axes = logical_axes_of(self.params)
        stateful = self.stateful
        s_axes = None
        if stateful:
            _, s_names = logical_axes_of(self.rest)
            s_axes = None if s_names is None else pure_names(self.rest, s_names)
        return dict(
            init=init,
            apply=self.apply,
            logical_axes=None if logical_axes is None else pure_names(self.params, logical_axes),
            abstract_params=nnx.to_pure_dict(abstract_of(self.params)),
            bind=self.bind,
            nnx_state=self.params,
            abstract_model_state=nnx.to_pure_dict(abstract_of(self.rest)) if stateful else None,
            model_state_axes=s_axes,
            init_state=init_state if stateful else None,
            needs_rng=bool(jax.tree.leaves(self.rng)),
        )


def abstract_of(state):
    """`state` with every array replaced by its ShapeDtypeStruct."""
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), state)


def pure_names(abs_state, axes_state):
    """Pure-dict tree of name tuples in the same nesting as `nnx.to_pure_dict(abs_state)`."""
    pure = nnx.to_pure_dict(abs_state)
    leaves, treedef = jax.tree.flatten(pure)
    names = jax.tree.leaves(axes_state, is_leaf=lambda x: x is None or isinstance(x, tuple))
    if len(names) != len(leaves):
        return None
    return jax.tree.unflatten(treedef, names)
