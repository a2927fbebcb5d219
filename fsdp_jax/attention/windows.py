"""Sliding windows in the flash ring (`fsdp_jax.attention.flash`) with kernels whose masks
are static (splash, cuDNN): each ring step as chunk pairs, each pair's static band chosen by
`lax.switch` on the rank.

    plan = window_plan(n=C, c=S // (2 * C), window=W, pattern=False)
    o, lse = window_fwd(kern, plan, t, (q, qp, qs), (k, v, kp, ks), local, i)

In the zig-zag layout rank i holds chunks i and 2C-1-i of c slots each, so at ring step t
(K/V of rank j = i - t mod C) a rank meets four (q chunk a, kv chunk b) pairs, and query slot
x of chunk a sees key slot y of chunk b iff 0 <= (a - b) c + x - y < W (the window: query
position minus key position below W, as transformers' Mistral / Gemma masks) and their
segments match. For a given chunk distance k = a - b that is a static band of x - y
(`pair_band`): empty (k < 0, or the window ends before the pair: every pair of a window
smaller than a chunk but the diagonal's and the next chunk's), FULL, CAUSAL, the diagonal's
Band(0, W), or Band(None, W - k c) for a pair the window's edge crosses (at most two such
distances). k depends on the rank (a traced axis index) and the ring step (static), so per
step and pair the plan lists the distinct bands over all ranks (and a pattern's local and
global layers: `local` is traced too) and a table from (local, rank) to the band's branch;
the ring runs `lax.switch` over those branches, one statically masked kernel call each, the
empty branch computing nothing. A pair empty on every rank is not traced at all.

The bands are by slot, the window of the XLA ring by positions: they agree because positions
advance by one per slot inside a segment (one row, or one packed example), which the
zig-zag layout keeps within each chunk. Kernels get the band as their `causal` argument
(`ring_kernels.Band`) and the ring's `local` flag they ignore.

Compile cost: per later step at most three traced pairs (two at a fixed chunk distance, one
rank-dependent), each with one c x c kernel call per band it may take, where the half-block
ring traces two calls of 2c x c (one per `lax.cond` branch). A window wider than the row traces
3 c x c calls a step (3 c^2 of kernel area against 4 c^2); a window shorter than a chunk only a
chunk's pairs with itself and its predecessor (128k at context 8, window 4096: 5 calls in all
against 15). At run time each rank computes only the branch its table selects.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax.attention.kernels import CAUSAL, FULL, Band, BlockKernel, merge


def pair_band(k: int, c: int, window: int, local: bool) -> Band | None:
    """The static band of q chunk a against kv chunk a - k (chunks of c slots) under a sliding
    `window` (when `local`); None when no query of the pair sees a key."""
    if k < 0:
        return None
    if k == 0:
        return Band(0, window) if local and window < c else CAUSAL
    if not local:
        return FULL
    hi = window - k * c  # x - y < hi, with x - y in [-(c - 1), c - 1]
    if hi > c - 1:
        return FULL
    if hi <= -(c - 1):
        return None
    return Band(None, hi)


class PairPlan(NamedTuple):
    """One (step, q chunk, kv chunk) pair: its distinct bands and (local flag, rank) -> branch
    (len(bands): empty)."""

    bands: tuple
    table: tuple  # (flags, C) ints
    empty: bool  # some rank's pair is empty


def _chunk(r: int, side: int, n: int) -> int:
    return r if side == 0 else 2 * n - 1 - r


def window_plan(*, n: int, c: int, window: int, pattern: bool) -> dict:
    """{(t, x, y): PairPlan} for every ring step t and local q chunk x / kv chunk y (0: a rank's
    first chunk, 1: its second) with a band on some rank; `pattern`: the local flag is traced
    (a pattern's global layers have no window), else the window always applies."""
    flags = (False, True) if pattern else (True,)
    plan = {}
    for t in range(n):
        for x in (0, 1):
            for y in (0, 1):
                rows = [
                    [pair_band(_chunk(i, x, n) - _chunk((i - t) % n, y, n), c, window, f) for i in range(n)]
                    for f in flags
                ]
                bands = tuple(dict.fromkeys(b for row in rows for b in row if b is not None))
                if not bands:
                    continue
                table = tuple(tuple(len(bands) if b is None else bands.index(b) for b in row) for row in rows)
                plan[(t, x, y)] = PairPlan(bands, table, any(b is None for row in rows for b in row))
    return plan


def _pick(pp: PairPlan, local, i, branches, operands):
    """Run the pair's branch for this rank and flag (`lax.switch`; a single band runs unswitched)."""
    if len(branches) == 1:
        return branches[0](operands)
    row = local.astype(jnp.int32) if len(pp.table) == 2 else 0
    return jax.lax.switch(jnp.asarray(pp.table, jnp.int32)[row, i], branches, operands)


def _halves(x, c):
    return x[:, :c], x[:, c:]


def window_fwd(kern: BlockKernel, plan: dict, t: int, qq, kv, local, i):
    """(o, lse) of rank i's queries (B, 2c, H, Dh) / (B, 2c, H) against ring step t's K/V block."""
    q, qp, qs = qq
    c = q.shape[1] // 2
    qh = [_halves(a, c) for a in (q, qp, qs)]
    kh = [_halves(a, c) for a in kv]
    b, _, h, dh = q.shape
    empty = (jnp.zeros((b, c, h, dh), jnp.float32), jnp.full((b, c, h), -jnp.inf, jnp.float32))
    outs = []
    for x in (0, 1):
        acc = empty
        for y in (0, 1):
            pp = plan.get((t, x, y))
            if pp is None:
                continue
            ops = (qh[0][x], kh[0][y], kh[1][y], qh[1][x], kh[2][y], qh[2][x], kh[3][y], local)

            def call(ops, band):
                return kern.fwd(*ops, band)

            branches = [lambda ops, band=band: call(ops, band) for band in pp.bands]
            if pp.empty:
                branches.append(lambda ops: empty)
            acc = merge(acc, _pick(pp, local, i, branches, ops))
        outs.append(acc)
    return tuple(jnp.concatenate(parts, 1) for parts in zip(*outs))


def window_bwd(kern: BlockKernel, plan: dict, t: int, qq, kv, local, out, i):
    """(dq, dk, dv) float32 of step t's block on rank i, given the ring's global `out` = (o, lse, do)."""
    q, qp, qs = qq
    k = kv[0]
    c = q.shape[1] // 2
    qh = [_halves(a, c) for a in (q, qp, qs, *out)]
    kh = [_halves(a, c) for a in kv]
    b, _, h, dh = q.shape
    dq = [jnp.zeros((b, c, h, dh), jnp.float32) for _ in (0, 1)]
    dk = [jnp.zeros((b, c, *k.shape[2:]), jnp.float32) for _ in (0, 1)]
    dv = [jnp.zeros((b, c, *k.shape[2:]), jnp.float32) for _ in (0, 1)]
    for x in (0, 1):
        for y in (0, 1):
            pp = plan.get((t, x, y))
            if pp is None:
                continue
            ops = (qh[0][x], kh[0][y], kh[1][y], qh[1][x], kh[2][y], qh[2][x], kh[3][y], local)
            ops = ops + (qh[3][x], qh[4][x], qh[5][x])  # the global o, lse, do of q chunk x

            def call(ops, band):
                return tuple(g.astype(jnp.float32) for g in kern.bwd(*ops, band))

            branches = [lambda ops, band=band: call(ops, band) for band in pp.bands]
            if pp.empty:
                branches.append(lambda ops, z=(dq[x], dk[y], dv[y]): tuple(jnp.zeros_like(a) for a in z))
            gq, gk, gv = _pick(pp, local, i, branches, ops)
            dq[x], dk[y], dv[y] = dq[x] + gq, dk[y] + gk, dv[y] + gv
    return tuple(jnp.concatenate(g, 1) for g in (dq, dk, dv))


def plan_summary(plan: dict) -> dict:
    """{'pairs': traced pairs, 'calls': kernel calls traced per direction, 'switched': pairs
    with a lax.switch} of a plan (tests and docs)."""
    calls = sum(len(p.bands) for p in plan.values())
    switched = sum(1 for p in plan.values() if len(p.bands) + p.empty > 1)
    return {
        "pairs": len(plan),
        "calls": calls,
        "switched": switched,
        "bands": np.unique([str(b) for p in plan.values() for b in p.bands]).tolist(),
    }
