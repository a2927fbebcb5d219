"""cuDNN's packed (THD) layout of one ring block: which query rows meet which key rows when
both sides carry packed rows' segment ids, as cuDNN's fused attention takes them.

    lay = block_layout(qs, ks, max_segments=128)     # qs (B, Sq), ks (B, Sk) int segment ids
    fa.dot_product_attention(q, k, v, q_seqlen=lay.q_seqlen, kv_seqlen=lay.kv_seqlen,
                             q_offsets=lay.q_offsets, kv_offsets=lay.kv_offsets, ...)

A block pairs a rank's queries with one K/V block of the zig-zag row (`fsdp_jax.sharding.
ring_flash`). Its q and kv sides are chunks of the row in ascending order, so a segment (one
packed example: a run of equal ids in the row, ids non-decreasing along the row, 0 = padding
only at its end) is one run on each side. Segment m of the layout is a segment present on BOTH
sides: q rows [q_offsets[m], + q_seqlen[m]) and kv rows [kv_offsets[m], + kv_seqlen[m]),
block-local; a segment on one side only is dropped (its queries see no key of the block:
`q_seg` -1, output 0 and lse -inf; its keys get no gradient: `kv_covered` False). Entries past
the last segment are -1 (seqlen (B, M), offsets (B, M + 1): jax's `dot_product_attention`
compacts them with `_fix_seqlen_offsets`). Padding (id 0) is a segment like any other, as
`fsdp_jax.app.models.attention.segment_mask` treats it.

Masks per block: the rank's own block uses PADDING_CAUSAL, and there q and kv segments are the
same rows (equal offsets and lengths), so cuDNN's causal alignment (top-left or bottom-right)
does not matter; the zig-zag half blocks have every key before every query and use PADDING
(same segment only). `thd_mask` is those semantics in pure JAX (the tests' emulation).

Softmax statistics: with offsets, jax gives cuDNN's stats as (B x M, N, Sq): row g is the g-th
segment over the batch (after compaction), column t' the query's place inside its segment.
`token_lse` reads them as (B, Sq, N) and `packed_stats` writes a per-token lse back (the ring's
global lse for the backward). That layout is read off jax 0.10.2's abstract eval and XLA's
operand order, not checked on a GPU here.

`max_segments` (M) is static: a block with more segments than M cannot be laid out, and the
kernel poisons that row's output with NaN (`overflow`) rather than drop segments silently. A
block's q side holds a subset of its row's segments, so M >= a row's segments (the trainer's
`model.max_segments`, checked per batch) rules that out. `span_layout` lays out one segment per
row by its spans (the windowed ring's reversed squares, `fsdp_jax.attention.cudnn_bands`).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

_LAST = jnp.iinfo(jnp.int32).max


class BlockLayout(NamedTuple):
    """One block's packed layout (module docstring); int32 throughout."""

    q_seqlen: jax.Array  # (B, M), -1 past the last segment
    kv_seqlen: jax.Array  # (B, M)
    q_offsets: jax.Array  # (B, M + 1), -1 past the last segment
    kv_offsets: jax.Array  # (B, M + 1)
    q_seg: jax.Array  # (B, Sq): the query's segment m, -1 where it meets no key
    q_pos: jax.Array  # (B, Sq): its place inside that segment
    kv_covered: jax.Array  # (B, Sk) bool: the key is in some segment m
    overflow: jax.Array  # (B,) bool: more than M segments on the q side


def _key(ids):
    """Segment ids as a non-decreasing sort key: padding (0, at a row's end) last."""
    ids = ids.astype(jnp.int32)
    return jnp.where(ids == 0, _LAST, ids)


def _runs(key, m):
    """Starts (B, M + 1) of the first M + 1 runs (fill S) and each slot's run index (B, S)."""
    b, s = key.shape
    start = jnp.concatenate([jnp.ones((b, 1), bool), key[:, 1:] != key[:, :-1]], axis=1)
    starts = jax.vmap(lambda x: jnp.nonzero(x, size=m + 1, fill_value=s)[0])(start)
    return starts.astype(jnp.int32), jnp.cumsum(start, axis=1, dtype=jnp.int32) - 1


def block_layout(qs, ks, *, max_segments: int) -> BlockLayout:
    """The packed layout of a block whose q side has segment ids qs (B, Sq) and kv side
    ks (B, Sk) (module docstring)."""
    b, sq = qs.shape
    m = max(2, min(max_segments, sq))  # M = 1 would read as no packed layout (`get_max_seg_per_batch`)
    qk, kk = _key(qs), _key(ks)
    starts, run = _runs(qk, m)
    qstart, qlen = starts[:, :m], starts[:, 1:] - starts[:, :m]  # (B, M); length 0 past the runs
    sid = jnp.take_along_axis(qk, jnp.minimum(qstart, sq - 1), axis=1)
    lo = jax.vmap(lambda x, v: jnp.searchsorted(x, v, side="left"))(kk, sid).astype(jnp.int32)
    hi = jax.vmap(lambda x, v: jnp.searchsorted(x, v, side="right"))(kk, sid).astype(jnp.int32)
    valid = (qlen > 0) & (hi > lo)
    order = jax.vmap(lambda x: jnp.nonzero(x, size=m, fill_value=m)[0])(valid)  # valid runs, left
    ok = order < m

    def pick(x):
        return jnp.where(ok, jnp.take_along_axis(x, jnp.minimum(order, m - 1), axis=1), -1)

    pad = jnp.full((b, 1), -1, jnp.int32)
    rank = jnp.cumsum(valid, axis=1, dtype=jnp.int32) - 1  # run -> its place among valid runs
    r = jnp.minimum(run, m - 1)
    seen = (run < m) & jnp.take_along_axis(valid, r, axis=1)
    q_seg = jnp.where(seen, jnp.take_along_axis(rank, r, axis=1), -1)
    q_pos = jnp.arange(sq, dtype=jnp.int32)[None] - jnp.take_along_axis(qstart, r, axis=1)
    # a key is covered when its id opens a valid q run
    qlo = jax.vmap(lambda x, v: jnp.searchsorted(x, v, side="left"))(qk, kk)
    qlo = jnp.minimum(qlo, sq - 1)
    krun = jnp.take_along_axis(run, qlo, axis=1)
    kr = jnp.minimum(krun, m - 1)
    kv_covered = (jnp.take_along_axis(qk, qlo, axis=1) == kk) & (krun < m) & jnp.take_along_axis(valid, kr, axis=1)
    return BlockLayout(
        pick(qlen),
        pick(hi - lo),
        jnp.concatenate([pick(qstart), pad], axis=1),
        jnp.concatenate([pick(lo), pad], axis=1),
        q_seg,
        jnp.where(seen, q_pos, 0),
        kv_covered,
        starts[:, m] < sq,
    )


def thd_mask(lay: BlockLayout, sq: int, sk: int, *, causal: bool, window: int | None = None):
    """(B, Sq, Sk) bool: query i attends key j iff some segment m holds i on its q side and j
    on its kv side, and (causal) j's place in the segment <= i's, and (window W) i's place - j's
    < W: cuDNN's packed semantics read from the layout's four arrays only (the reference for
    `block_layout`)."""
    qo, ko = lay.q_offsets[:, :-1], lay.kv_offsets[:, :-1]
    i = jnp.arange(sq)[None, :, None]  # (1, Sq, 1) against (B, 1, M)
    j = jnp.arange(sk)[None, :, None]
    in_q = (qo[:, None] >= 0) & (i >= qo[:, None]) & (i < qo[:, None] + lay.q_seqlen[:, None])  # (B, Sq, M)
    in_k = (ko[:, None] >= 0) & (j >= ko[:, None]) & (j < ko[:, None] + lay.kv_seqlen[:, None])  # (B, Sk, M)
    both = in_q[:, :, None, :] & in_k[:, None, :, :]  # (B, Sq, Sk, M)
    gap = (i[:, :, None, :] - qo[:, None, None]) - (j[:, None, :, :] - ko[:, None, None])  # (B, Sq, Sk, M)
    if causal:
        both = both & (gap >= 0)
    if window:
        both = both & (gap < window)
    return jnp.any(both, axis=-1)


def span_layout(q_lo, q_len, kv_lo, kv_len, sq: int, sk: int) -> BlockLayout:
    """The packed layout of ONE segment per row: q rows [q_lo, q_lo + q_len) against kv rows
    [kv_lo, kv_lo + kv_len) ((B,) int each; a row with either length 0 has none), M = 2.
    For a block whose keys all precede its queries, where at most one segment (the one across
    the gap) is on both sides."""
    b = q_lo.shape[0]
    on = (q_len > 0) & (kv_len > 0)
    none = jnp.full((b, 1), -1, jnp.int32)

    def entry(x):
        return jnp.concatenate([jnp.where(on, x, -1).astype(jnp.int32)[:, None], none], axis=1)

    x = jnp.arange(sq, dtype=jnp.int32)[None]
    y = jnp.arange(sk, dtype=jnp.int32)[None]
    in_q = on[:, None] & (x >= q_lo[:, None]) & (x < (q_lo + q_len)[:, None])
    in_k = on[:, None] & (y >= kv_lo[:, None]) & (y < (kv_lo + kv_len)[:, None])
    return BlockLayout(
        entry(q_len),
        entry(kv_len),
        jnp.concatenate([entry(q_lo), none], axis=1),
        jnp.concatenate([entry(kv_lo), none], axis=1),
        jnp.where(in_q, 0, -1).astype(jnp.int32),
        jnp.where(in_q, x - q_lo[:, None], 0).astype(jnp.int32),
        in_k,
        jnp.zeros((b,), bool),
    )


def _stat_rows(lay: BlockLayout):
    """(B, Sq) row of cuDNN's (B x M, N, Sq) stats for each query; B x M where it has none."""
    b, m = lay.q_seqlen.shape
    per_row = jnp.sum(lay.q_seqlen >= 0, axis=1, dtype=jnp.int32)
    base = jnp.cumsum(per_row) - per_row  # segments of the rows before
    return jnp.where(lay.q_seg >= 0, base[:, None] + lay.q_seg, b * m)


def token_lse(stats, lay: BlockLayout):
    """cuDNN's packed stats (B x M, N, Sq) -> lse (B, Sq, N) float32, -inf for uncovered queries."""
    rows = _stat_rows(lay)
    lse = stats.astype(jnp.float32)[jnp.minimum(rows, stats.shape[0] - 1), :, lay.q_pos]  # (B, Sq, N)
    return jnp.where((lay.q_seg >= 0)[..., None], lse, -jnp.inf)


def packed_stats(lse, lay: BlockLayout):
    """A per-token lse (B, Sq, N) -> cuDNN's packed stats (B x M, N, Sq) float32."""
    b, sq, n = lse.shape
    m = lay.q_seqlen.shape[1]
    out = jnp.zeros((b * m, n, sq), jnp.float32)
    return out.at[_stat_rows(lay), :, lay.q_pos].set(lse.astype(jnp.float32), mode="drop")
