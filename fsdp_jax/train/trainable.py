"""Frozen params (LoRA-style fine-tuning): which leaves the train step differentiates.

`trainable` is None (every leaf), a tree of Python bools matching the params (a prefix
is broadcast) or a callable `params -> that tree`; `Trainable` selects the trainable
leaves for differentiation and fills zero grads (in the grad layout) for the rest.
`fsdp_jax.train.step` re-exports both.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax.sharding.mesh import constrain


class Trainable:
    """What the step differentiates: the whole param tree (`trainable` None, the
    default) or the list of trainable leaves, with frozen leaves held constant."""

    def __init__(self, params, trainable):
        self.leaves, self.treedef = jax.tree.flatten(params)
        self.keep = None if trainable is None else trainable_leaves(params, trainable)

    def select(self, tree):
        """`tree` (params-shaped) as the differentiated argument: itself, or its trainable leaves."""
        if self.keep is None:
            return tree
        return [x for x, k in zip(self.treedef.flatten_up_to(tree), self.keep) if k]

    def join(self, x):
        """The full param tree from the differentiated argument and the frozen leaves."""
        if self.keep is None:
            return x
        it = iter(x)
        return self.treedef.unflatten([next(it) if k else p for p, k in zip(self.leaves, self.keep)])

    def frozen_from(self, new, old):
        """`new` (params-shaped) with its frozen leaves taken from `old`: whatever the
        optimizer made of their zero grads, frozen params leave the step as they came."""
        if self.keep is None:
            return new
        pairs = zip(self.treedef.flatten_up_to(new), self.treedef.flatten_up_to(old), self.keep)
        return self.treedef.unflatten([n if k else o for n, o, k in pairs])

    def full_grads(self, grads, grad_sh):
        """Params-shaped grads: zeros (in the grad layout) for frozen leaves."""
        if self.keep is None:
            return grads
        it = iter(grads)
        out = [
            next(it) if k else _zeros_like(p, s)
            for p, k, s in zip(self.leaves, self.keep, self.treedef.flatten_up_to(grad_sh))
        ]
        return self.treedef.unflatten(out)


def trainable_leaves(params, trainable) -> list[bool]:
    """One Python bool per leaf of `params` from `trainable`: a tree of bools matching
    `params` (or a prefix of it, broadcast), or a callable `params -> that tree`."""
    mask = trainable(params) if callable(trainable) else trainable
    try:
        full = jax.tree.map(lambda b, sub: jax.tree.map(lambda _: b, sub), mask, params)
        flat = jax.tree.structure(params).flatten_up_to(full)
    except (ValueError, TypeError) as e:
        raise ValueError(f"trainable does not match the params tree: {e}") from None
    bad = [b for b in flat if not isinstance(b, (bool, np.bool_))]
    if bad:
        raise ValueError(f"trainable leaves must be Python bools, got {type(bad[0]).__name__}")
    return [bool(b) for b in flat]


def _zeros_like(p, sharding):
    return constrain(jnp.zeros(p.shape, p.dtype), sharding)
