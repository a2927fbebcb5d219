"""Context-parallel causal attention over the `context` mesh axis (ring or all-gather).

    o = context_attention(q, k, v, positions, segment_ids, scale=Dh ** -0.5)

q (B, S, H, Dh), k / v (B, S, K, Dh) (grouped-query: H a multiple of K), positions and
segment ids (B, S) int, all in the zig-zag layout of `fsdp_jax.sharding.context` with S
sharded over `context`. Under `shard_map` (batch, heads and sequence dims split as the
logical rules say), each rank keeps its queries and meets every rank's keys in C
steps, merging each block's scores into running softmax statistics (max, sum, output),
so no rank ever holds more than one score block (`q_chunk` queries x S/C keys) at a time:

* `kv_pass="ring"`: the K/V block (with its positions and segment ids) moves one rank
  along the ring per step (`ppermute`); the next block's transfer is issued before the
  current block's compute, so the scheduler can overlap them.
* `kv_pass="all_gather"`: one all-gather of K/V over `context` up front, then the same
  C steps over slices of it: K/V are K/H of q's size under grouped-query attention.

Masking is by values, never by slot: query i may attend key j when their segment ids
match, pos_j <= pos_i, and (with `window`) pos_i - pos_j < window (`local` False turns
the window off for a global layer of a pattern); scores are `softcap`ped first. In the
zig-zag layout rank i holds chunks (i, 2C-1-i); at step t it meets rank j = i - t's
chunks: for j < i only the first half of j's block can be attended (by all its
queries), for j > i only its own second-half queries attend (all of j's keys), so each
step after the first computes half a block, equally on every rank. Each block is
rematerialised in the backward pass (`jax.checkpoint`): the saved residuals are the
running statistics, not the score blocks.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from fsdp_jax.sharding.axes import BATCH, CONTEXT, HEADS, KV, KV_HEADS, LENGTH
from fsdp_jax.sharding.context import context_size
from fsdp_jax.sharding.rules import flax_rules

KV_PASSES = ("ring", "all_gather")
# Queries per score block: a block's (q_chunk x S/C) f32 scores per head are all one step
# keeps. 2048 keeps Llama-3-8B's 32 heads at 128k / 8 ranks to 2.1 GB per block (an unsplit
# half-block would be 16.8 GB: the 8 x H100 128k plan compiled to 116.5 GB without it).
Q_CHUNK = 2048


def _stats(q, k, v, qp, kp, qs, ks, scale, cap, window, local):
    """One block: (unnormalised output (B, K, G, Sq, Dh) f32, max, sum (B, K, G, Sq))."""
    b, sq, h, dh = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, sq, kvh, h // kvh, dh)
    s = jnp.einsum("bskgd,btkd->bkgst", qg, k, preferred_element_type=jnp.float32) * scale
    if cap:
        s = jnp.tanh(s / cap) * cap
    mask = (qs[:, :, None] == ks[:, None, :]) & (kp[:, None, :] <= qp[:, :, None])  # (B, Sq, Sk)
    if window:
        inside = qp[:, :, None] - kp[:, None, :] < window
        mask = mask & (inside if local is None else (inside | ~local))
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    m = jax.lax.stop_gradient(jnp.max(s, axis=-1))  # the result does not depend on m
    p = jnp.exp(s - jnp.where(jnp.isfinite(m), m, 0.0)[..., None])
    o = jnp.einsum("bkgst,btkd->bkgsd", p.astype(v.dtype), v, preferred_element_type=jnp.float32)
    return o, m, p.sum(-1)


def _merge(a, b):
    (oa, ma, la), (ob, mb, lb) = a, b
    m = jnp.maximum(ma, mb)
    ms = jnp.where(jnp.isfinite(m), m, 0.0)
    ca, cb = jnp.exp(ma - ms), jnp.exp(mb - ms)
    return oa * ca[..., None] + ob * cb[..., None], m, la * ca + lb * cb


def _empty(q, kvh):
    b, sq, h, dh = q.shape
    shape = (b, kvh, h // kvh, sq)
    return jnp.zeros(shape + (dh,), jnp.float32), jnp.full(shape, -jnp.inf), jnp.zeros(shape)


def _chunked(block, q_chunk: int):
    """`block` over query chunks of `q_chunk` (`lax.map`, one chunk's scores live at a time);
    the whole block when the queries are no longer than that or do not divide by it."""

    def run(q, k, v, qp, kp, qs, ks):
        sq = q.shape[1]
        if sq <= q_chunk or sq % q_chunk:
            return block(q, k, v, qp, kp, qs, ks)
        n = sq // q_chunk

        def split(x):  # (B, Sq, ...) -> (n, B, q_chunk, ...)
            return jnp.moveaxis(x.reshape(x.shape[0], n, q_chunk, *x.shape[2:]), 1, 0)

        outs = jax.lax.map(lambda a: block(a[0], k, v, a[1], kp, a[2], ks), (split(q), split(qp), split(qs)))
        # (n, B, K, G, q_chunk, ...) -> (B, K, G, Sq, ...): chunk j holds queries [j c, (j+1) c)
        return tuple(jnp.moveaxis(x, 0, 3).reshape(*x.shape[1:4], sq, *x.shape[5:]) for x in outs)

    return run


def _half_block(q, kv, block, j, i):
    """Step with rank j's block on rank i (j != i): the half the zig-zag causal mask
    leaves (j < i: all queries x first-half keys; j > i: second-half queries x all keys)."""
    k, v, kp, ks = kv
    qq, qp, qs = q
    half = qq.shape[1] // 2

    def earlier(_):
        return block(qq, k[:, :half], v[:, :half], qp, kp[:, :half], qs, ks[:, :half])

    def later(_):
        o, m, l_ = block(qq[:, half:], k, v, qp[:, half:], kp, qs[:, half:], ks)
        e = _empty(qq[:, :half], k.shape[2])
        return tuple(jnp.concatenate([x, y], axis=3) for x, y in zip(e, (o, m, l_)))

    return jax.lax.cond(j < i, earlier, later, None)


def _local_attention(q, k, v, qp, kp, qs, ks, local, *, scale, cap, window, kv_pass, n, q_chunk):
    """The per-rank body under shard_map: shapes are the local (S / C) slices."""
    block = jax.checkpoint(functools.partial(_stats, scale=scale, cap=cap, window=window, local=local))
    block = _chunked(block, q_chunk)
    i = jax.lax.axis_index(CONTEXT)
    qq = (q, qp, qs)
    kv = (k, v, kp, ks)
    if kv_pass == "all_gather":
        full = jax.lax.all_gather(kv, CONTEXT, axis=1, tiled=True)
    acc = block(q, k, v, qp, kp, qs, ks)  # step 0: own block, causal inside it
    ring = [(r, (r + 1) % n) for r in range(n)]
    for t in range(1, n):
        j = (i - t) % n
        if kv_pass == "ring":
            kv = jax.lax.ppermute(kv, CONTEXT, ring)
        else:
            sc = q.shape[1]
            kv = tuple(jax.lax.dynamic_slice_in_dim(x, j * sc, sc, axis=1) for x in full)
        acc = _merge(acc, _half_block(qq, kv, block, j, i))
    o, _, l_ = acc
    b, sq, h, dh = q.shape
    o = o / jnp.where(l_ > 0, l_, 1.0)[..., None]  # (B, K, G, Sq, Dh)
    return jnp.moveaxis(o, 3, 1).reshape(b, sq, h, dh).astype(q.dtype)


def context_attention(
    q,
    k,
    v,
    positions,
    segment_ids=None,
    *,
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
    local=None,
    kv_pass: str = "ring",
    q_chunk: int = Q_CHUNK,
):
    """Causal attention of zig-zag-ordered rows sharded over `context` (module docstring).

    `positions` (B, S) are required (the layout hides the row order); `segment_ids`
    None means one segment per row; `local` a traced bool scalar or None."""
    if kv_pass not in KV_PASSES:
        raise ValueError(f"kv_pass {kv_pass!r}: choose one of {', '.join(KV_PASSES)}")
    if positions is None:
        raise ValueError("context_attention needs positions (B, S): rows are in zig-zag order")
    n = context_size()
    seg = jnp.zeros(positions.shape, jnp.int32) if segment_ids is None else segment_ids
    flag = jnp.asarray(True) if local is None else jnp.asarray(local)
    body = functools.partial(
        _local_attention, scale=scale, cap=softcap, window=window, kv_pass=kv_pass, n=n, q_chunk=q_chunk
    )
    qs, kvs, seq = context_specs()
    fn = jax.shard_map(
        lambda *a: body(*a[:-1], None if local is None else a[-1]),
        in_specs=(qs, kvs, kvs, seq, seq, seq, seq, P()),
        out_specs=qs,
        check_vma=False,
    )
    return fn(q, k, v, positions, positions, seg, seg, flag)


def context_specs() -> tuple[P, P, P]:
    """Specs of q, k / v and the (B, S) ids from the logical rules current while tracing
    (Flax's `logical_axis_rules`, else DEFAULT_RULES): every mesh axis is manual inside,
    so each rank attends its own batch rows and heads only."""

    rules = nn.get_logical_axis_rules() or flax_rules()
    names = ((BATCH, LENGTH, HEADS, KV), (BATCH, LENGTH, KV_HEADS, KV), (BATCH, LENGTH))
    specs = [P(*nn.logical_to_mesh_axes(n, rules)) for n in names]
    if any(s[1] != CONTEXT for s in specs):
        raise ValueError(f"context_attention needs the rule length -> context; the rules give {specs[0]}")
    return tuple(specs)
