"""A ring block's static band (`ring_kernels.Band`) as cuDNN calls: cuDNN's fused attention
masks are NO_MASK, CAUSAL (top-left: key y <= query x) and CAUSAL with a sliding window W
(x - W < y <= x), so a band whose window edge crosses a chunk pair (keys y >= x - s only:
Band(None, s + 1)) becomes pieces of those, some with both sides reversed.

    pieces = band_pieces(Band(None, -3), 8, 8)   # [(q 0:5, kv 3:8, "anti")]
    fwd, bwd = by_pieces(piece_fwd, piece_bwd)   # a BlockKernel's fwd / bwd over the pieces

"anti" (key y >= query x on a square) is CAUSAL on both sides reversed: query x' = L-1-x and
key y' = L-1-y see y' <= x'. Each piece's (o, lse) covers its query rows; pieces merge by
log-sum-exp; in the backward each piece is given the ring's global o and lse of its rows and
its dq / dk / dv add into the block's.
"""

from __future__ import annotations

import jax.numpy as jnp

from fsdp_jax.attention.kernels import CAUSAL, FULL, Band, as_band, merge


def band_pieces(band: Band, sq: int, sk: int) -> list:
    """cuDNN calls covering a `Band` of an Sq x Sk block (Sq == Sk but for FULL / CAUSAL):
    (q slice, kv slice, kind), kind "full" (NO_MASK), "causal" (CAUSAL), an int W (CAUSAL with
    cuDNN's sliding window W) or "anti" (key y >= query x: CAUSAL on both sides reversed). A
    window's edge Band(None, h) (x - y < h) with s = h - 1: s < 0 leaves the square
    q [0, Sq + s) x kv [-s, Sk), anti; s >= 0 is q [0, s] x all kv (full), q (s, Sq) x kv
    [Sk - s, Sk) (full) and q (s, Sq) x kv [1, Sk - s) (anti)."""
    whole = (slice(0, sq), slice(0, sk))
    if band == FULL:
        return [(*whole, "full")]
    if band == CAUSAL:
        return [(*whole, "causal")]
    if band.lo == 0 and band.hi is not None:
        return [(*whole, int(band.hi))]
    if band.lo is not None or band.hi is None or sq != sk:
        raise ValueError(f"no cuDNN pieces for {band} on a {sq} x {sk} block")
    s = band.hi - 1
    if s < 0:
        return [(slice(0, sq + s), slice(-s, sk), "anti")]
    pieces = [(slice(0, s + 1), slice(0, sk), "full")]
    if s > 0:
        pieces.append((slice(s + 1, sq), slice(sk - s, sk), "full"))
    if sq - s - 1 > 0:
        pieces.append((slice(s + 1, sq), slice(1, sk - s), "anti"))
    return pieces


def piece_window(kind) -> int | None:
    """cuDNN's sliding_window_length of a piece (None: no window)."""
    return kind if isinstance(kind, int) and not isinstance(kind, bool) else None


def by_pieces(piece_fwd, piece_bwd):
    """(fwd, bwd) with a `BlockKernel`'s signatures running each block's band as `band_pieces`:
    piece_fwd(q, k, v, qs, ks, kind) -> (o, lse) float32 of the piece's rows, piece_bwd(q, k, v,
    qs, ks, kind, o, lse, do) -> (dq, dk, dv); "anti" pieces get every operand reversed along
    the sequence (segment ids too) and their results are reversed back."""

    def flip(xs, kind):
        return [jnp.flip(x, 1) for x in xs] if kind == "anti" else list(xs)

    def fwd(q, k, v, qp, kp, qs, ks, local, causal):
        del qp, kp, local  # the band is the whole static structure
        b, sq, h, dh = q.shape
        pieces = band_pieces(as_band(causal), sq, k.shape[1])
        if len(pieces) == 1 and pieces[0][2] != "anti":  # the whole block in one call
            return piece_fwd(q, k, v, qs, ks, pieces[0][2])
        acc = (jnp.zeros((b, sq, h, dh), jnp.float32), jnp.full((b, sq, h), -jnp.inf, jnp.float32))
        for qi, ki, kind in pieces:
            args = flip((q[:, qi], k[:, ki], v[:, ki], qs[:, qi], ks[:, ki]), kind)
            o, lse = flip(piece_fwd(*args, kind), kind)
            pad = [(0, 0), (qi.start, sq - qi.stop)]
            o = jnp.pad(o, pad + [(0, 0), (0, 0)])
            lse = jnp.pad(lse, pad + [(0, 0)], constant_values=-jnp.inf)
            acc = merge(acc, (o, lse))
        return acc

    def bwd(q, k, v, qp, kp, qs, ks, local, o, lse, do, causal):
        del qp, kp, local
        pieces = band_pieces(as_band(causal), q.shape[1], k.shape[1])
        if len(pieces) == 1 and pieces[0][2] != "anti":
            return piece_bwd(q, k, v, qs, ks, pieces[0][2], o, lse, do)
        dq = jnp.zeros(q.shape, jnp.float32)
        dk = jnp.zeros(k.shape, jnp.float32)
        dv = jnp.zeros(v.shape, jnp.float32)
        for qi, ki, kind in pieces:
            args = flip((q[:, qi], k[:, ki], v[:, ki], qs[:, qi], ks[:, ki]), kind)
            rows = flip((o[:, qi], lse[:, qi], do[:, qi]), kind)
            gq, gk, gv = flip(piece_bwd(*args, kind, *rows), kind)
            dq, dk, dv = dq.at[:, qi].add(gq), dk.at[:, ki].add(gk), dv.at[:, ki].add(gv)
        return dq, dk, dv

    return fwd, bwd
