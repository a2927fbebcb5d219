"""Logical names a Flax model carries as metadata (`nnx.with_partitioning`,
`nn.with_logical_partitioning`), read into a tree of name tuples for the rules table
(`fsdp_jax.sharding.rules`, which re-exports `logical_axes_of`)."""

from __future__ import annotations

import jax
import numpy as np
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P


def logical_axes_of(tree):
    """Logical names carried as metadata: Flax NNX `State`s of Variables created with
    `nnx.with_partitioning`, or Linen variables boxed by `nn.with_logical_partitioning`.

    Returns (values, logical_axes): the plain value tree and a matching tree of
    name tuples (None where a leaf has no annotation), or (tree, None) when nothing
    carries metadata.
    """

    if isinstance(tree, nnx.State) or any(
        isinstance(x, nnx.Variable) for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nnx.Variable))
    ):
        specs = nnx.get_partition_spec(tree)
        values = tree
    elif any(
        isinstance(x, nn.spmd.LogicallyPartitioned)
        for x in jax.tree.leaves(tree, is_leaf=lambda x: isinstance(x, nn.spmd.LogicallyPartitioned))
    ):
        specs = nn.get_partition_spec(tree)
        values = nn.unbox(tree)
    else:
        return tree, None
    flat_vals, treedef = jax.tree.flatten(values)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    if len(flat_specs) != len(flat_vals):
        return values, None
    names = [tuple(s) if len(s) else (None if np.ndim(v) else ()) for s, v in zip(flat_specs, flat_vals)]
    return values, jax.tree.unflatten(treedef, names)
