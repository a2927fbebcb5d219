"""Block kernels for the flash ring (`fsdp_jax.attention.flash`): one ring step's
attention of a rank's queries against one K/V block, forward and backward.

    kern = reference_kernel(scale=Dh ** -0.5, softcap=0.0, window=0)
    o, lse = kern.fwd(q, k, v, qp, kp, qs, ks, local, causal)
    dq, dk, dv = kern.bwd(q, k, v, qp, kp, qs, ks, local, o, lse, do, causal)

q (B, Sq, H, Dh), k / v (B, Sk, K, Dh) (grouped-query: H a multiple of K), qp / kp
positions and qs / ks segment ids (B, Sq) / (B, Sk) int, `local` a bool scalar (the
sliding window applies when True). `causal` is static: True for a rank's own block (in
the zig-zag layout that is a causal mask over slot indices, Sq == Sk), False for the half
blocks of later ring steps (every query may see every key, segments and window aside), or a
`Band` (a kernel whose `BlockKernel.window` is set: the windowed ring of
`fsdp_jax.attention.windows` gives each chunk pair its static band of slot offsets).

`fwd` returns the block's normalised output o_j (B, Sq, H, Dh) and its log-sum-exp
lse_j (B, Sq, H), both float32 (-inf for a query that sees no key of the block). `bwd`
takes the ring's GLOBAL output o and log-sum-exp lse (not the block's), so its
P = exp(S - lse) and D = rowsum(dO * o) are the whole row's, and the block's dq, dk, dv
(float32) add up over the ring to the gradient of the merged attention.

`reference_kernel` is pure JAX in float32 with an exact softmax (CPU, tests); the splash
(TPU) and cuDNN (GPU) kernels have the same interface (`ring_splash`, `ring_cudnn`).
"""

from __future__ import annotations

import functools
from typing import Callable, NamedTuple

import jax.numpy as jnp


class BlockKernel(NamedTuple):
    """One ring step's attention: `fwd` -> (o_j, lse_j), `bwd` -> (dq, dk, dv) (module
    docstring); `segments` False: the kernel ignores segment ids (the ring refuses packed rows);
    `window` > 0: the ring applies this sliding window by static `Band`s per chunk pair
    (`fsdp_jax.attention.windows`), the kernel only follows the band it is given."""

    fwd: Callable
    bwd: Callable
    segments: bool = True
    window: int = 0


class Band(NamedTuple):
    """A block's static mask by slot: query slot x sees key slot y iff lo <= x - y < hi
    (None: no bound). CAUSAL = Band(0, None), FULL = Band(None, None); a window W on the
    diagonal is Band(0, W); a chunk pair d slots apart under a window is Band(None, W - d)."""

    lo: int | None = None
    hi: int | None = None


CAUSAL = Band(0, None)
FULL = Band(None, None)


def as_band(causal) -> Band:
    """A kernel's `causal` argument (bool or Band) as a Band."""
    return causal if isinstance(causal, Band) else (CAUSAL if causal else FULL)


def band_mask(band: Band, sq: int, sk: int):
    """(Sq, Sk) bool of a Band."""
    d = jnp.arange(sq)[:, None] - jnp.arange(sk)[None, :]
    mask = jnp.ones((sq, sk), bool)
    if band.lo is not None:
        mask = mask & (d >= band.lo)
    if band.hi is not None:
        mask = mask & (d < band.hi)
    return mask


def block_mask(qp, kp, qs, ks, local, *, causal, window: int):
    """(B, Sq, Sk) bool: segments match, the static structure (`causal`: True = slot i sees
    slot j <= i, False = all, or a `Band`) and, with `window`, pos_q - pos_k < window where
    `local`."""
    mask = qs[:, :, None] == ks[:, None, :]
    band = as_band(causal)
    if band != FULL:
        mask = mask & band_mask(band, qs.shape[1], ks.shape[1])[None]
    if window:
        inside = qp[:, :, None] - kp[:, None, :] < window
        mask = mask & (inside | ~local)
    return mask


def _scores(q, k, scale, cap):
    """Grouped scores (B, K, G, Sq, Sk) float32 and tanh(s / cap) (None without a cap)."""
    b, sq, h, dh = q.shape
    kvh = k.shape[2]
    qg = q.astype(jnp.float32).reshape(b, sq, kvh, h // kvh, dh)
    s = jnp.einsum("bskgd,btkd->bkgst", qg, k.astype(jnp.float32)) * scale
    if not cap:
        return s, None
    t = jnp.tanh(s / cap)
    return t * cap, t


def _lse_layout(x, h):
    """(B, K, G, Sq) -> (B, Sq, H)."""
    b, kvh, g, sq = x.shape
    return jnp.moveaxis(x, 3, 1).reshape(b, sq, h)


def _grouped(x, kvh):
    """(B, Sq, H[, Dh]) -> (B, K, G, Sq[, Dh])."""
    b, sq, h = x.shape[:3]
    y = x.reshape(b, sq, kvh, h // kvh, *x.shape[3:])
    return jnp.moveaxis(y, 1, 3)


def reference_kernel(
    *, scale: float, softcap: float = 0.0, window: int = 0, mask: Callable | None = None, banded: bool = False
) -> BlockKernel:
    """The pure-JAX block kernel (float32, exact softmax): the flash kernels' reference. `mask`
    (qp, kp, qs, ks, local, causal=) -> (B, Sq, Sk) bool replaces `block_mask` (tests feed it
    cuDNN's packed-layout semantics, `fsdp_jax.attention.cudnn_packed.thd_mask`). The window
    masks by positions, unless `banded`: then the ring applies it by slot bands, as it does
    for splash and cuDNN (`BlockKernel.window`)."""
    mask_of = mask or functools.partial(block_mask, window=0 if banded else window)

    def fwd(q, k, v, qp, kp, qs, ks, local, causal):
        h = q.shape[2]
        s, _ = _scores(q, k, scale, softcap)
        mask = mask_of(qp, kp, qs, ks, local, causal=causal)[:, None, None]
        s = jnp.where(mask, s, -jnp.inf)
        m = jnp.max(s, axis=-1)
        ms = jnp.where(jnp.isfinite(m), m, 0.0)
        p = jnp.exp(s - ms[..., None])
        den = p.sum(-1)
        o = jnp.einsum("bkgst,btkd->bkgsd", p, v.astype(jnp.float32)) / jnp.where(den > 0, den, 1.0)[..., None]
        lse = jnp.where(den > 0, ms + jnp.log(jnp.where(den > 0, den, 1.0)), -jnp.inf)
        b, sq, _, dh = q.shape
        return jnp.moveaxis(o, 3, 1).reshape(b, sq, h, dh), _lse_layout(lse, h)

    def bwd(q, k, v, qp, kp, qs, ks, local, o, lse, do, causal):
        b, sq, h, dh = q.shape
        kvh = k.shape[2]
        s, t = _scores(q, k, scale, softcap)
        mask = mask_of(qp, kp, qs, ks, local, causal=causal)[:, None, None]
        lg = _grouped(lse, kvh)  # (B, K, G, Sq)
        p = jnp.where(mask, jnp.exp(s - jnp.where(jnp.isfinite(lg), lg, 0.0)[..., None]), 0.0)
        dog = _grouped(do.astype(jnp.float32), kvh)  # (B, K, G, Sq, Dh)
        dsum = jnp.sum(dog * _grouped(o.astype(jnp.float32), kvh), axis=-1)  # D = rowsum(dO * o)
        dv = jnp.einsum("bkgst,bkgsd->btkd", p, dog)
        dp = jnp.einsum("bkgsd,btkd->bkgst", dog, v.astype(jnp.float32))
        ds = p * (dp - dsum[..., None])
        if softcap:
            ds = ds * (1.0 - t * t)
        qg = _grouped(q.astype(jnp.float32), kvh)
        dq = jnp.einsum("bkgst,btkd->bkgsd", ds, k.astype(jnp.float32)) * scale
        dk = jnp.einsum("bkgst,bkgsd->btkd", ds, qg) * scale
        return jnp.moveaxis(dq, 3, 1).reshape(b, sq, h, dh), dk, dv

    return BlockKernel(fwd, bwd, window=window if banded else 0)


def merge(a, b):
    """Two blocks' (o, lse) merged by log-sum-exp: lse = logaddexp(lse_a, lse_b),
    o = exp(lse_a - lse) o_a + exp(lse_b - lse) o_b (float32; -inf rows stay -inf, o 0)."""
    (oa, la), (ob, lb) = a, b
    lse = jnp.logaddexp(la, lb)
    ls = jnp.where(jnp.isfinite(lse), lse, 0.0)
    wa = jnp.where(jnp.isfinite(la), jnp.exp(la - ls), 0.0)
    wb = jnp.where(jnp.isfinite(lb), jnp.exp(lb - ls), 0.0)
    return oa * wa[..., None] + ob * wb[..., None], lse
