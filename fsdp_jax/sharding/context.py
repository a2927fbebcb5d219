"""The `context` mesh axis's sequence layout: zig-zag order, so causal work is balanced.

With the sequence dim of activations sharded over `context` (the rules row
`length -> context`), rank i of C holds one contiguous S / C slice of each row. Causal
attention then gives the last rank C times the first's work. The zig-zag order cuts a
row into 2C chunks and gives rank i chunks i and 2C - 1 - i: every rank holds one early
and one late chunk, and each ring step of `fsdp_jax.attention.ring` skips the
half of its block that the causal mask removes, on every rank alike.

    perm = zigzag_order(seq_len, context)   # (S,) int: row position of each slot
    batch = zigzag(batch, context)          # every (B, S) leaf permuted on dim 1

A loss that is a sum or mean over tokens is unchanged by the permutation, so a loss
function permutes its inputs, targets, weights, segment ids and positions alike and the
model sees each token with its own RoPE position; attention masks by positions and
segment ids, never by slot index. Model code calls `context_size()`, never a mesh.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax.errors import BatchError
from fsdp_jax.sharding.axes import CONTEXT


def context_size() -> int:
    """Size of the `context` axis of the mesh current while tracing (1 without one)."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        return 1
    return dict(mesh.shape).get(CONTEXT, 1)


def check_seq_len(seq_len: int, context: int) -> None:
    """Raise BatchError unless `seq_len` splits into 2 x `context` equal chunks."""
    if context > 1 and seq_len % (2 * context):
        raise BatchError(
            f"sequence length {seq_len} must be divisible by 2 x context = {2 * context} "
            f"(the zig-zag layout gives each of the {context} context ranks two equal chunks)"
        )


def zigzag_order(seq_len: int, context: int) -> np.ndarray:
    """(S,) int32: the row position held by each slot of the zig-zag layout (slots
    [i S/C, (i+1) S/C) are rank i's: chunk i, then chunk 2C - 1 - i)."""
    check_seq_len(seq_len, context)
    chunks = np.arange(seq_len, dtype=np.int32).reshape(2 * context, -1)
    order = [c for i in range(context) for c in (chunks[i], chunks[2 * context - 1 - i])]
    return np.concatenate(order)


def zigzag(tree, context: int, axis: int = 1):
    """Every leaf of `tree` permuted into zig-zag order along `axis` (its sequence dim);
    `tree` unchanged when `context` is 1."""
    if context == 1:
        return tree
    leaves = jax.tree.leaves(tree)
    perm = zigzag_order(leaves[0].shape[axis], context)
    return jax.tree.map(lambda x: jnp.take(x, jnp.asarray(perm), axis=axis), tree)


def unzigzag(tree, context: int, axis: int = 1):
    """The inverse of `zigzag`: leaves back in row order."""
    if context == 1:
        return tree
    leaves = jax.tree.leaves(tree)
    inv = np.argsort(zigzag_order(leaves[0].shape[axis], context)).astype(np.int32)
    return jax.tree.map(lambda x: jnp.take(x, jnp.asarray(inv), axis=axis), tree)
