"""The splash block kernel of the flash ring (TPU): JAX's Pallas splash attention
(`jax.experimental.pallas.ops.tpu.splash_attention`) per ring block, forward and backward.

    kern = splash_kernel(scale=Dh ** -0.5, softcap=0.0)
    o = flash_context_attention(q, k, v, positions, segment_ids, kernel=kern)   # ring_flash

Forward: the kernel built with `save_residuals=True` returns (o_j, (lse_j,)). Backward:
splash's own backward (`splash_attention_kernel._splash_attention_bwd`, private: its
residual tuple (q, k, v, segment_ids, sinks, o, logsumexp, dq_mask_info, dkv_mask_info)
is pinned by tests/test_ring_splash.py) given the ring's GLOBAL o and lse, so its
di = rowsum(dO * o) and P = exp(S - lse) are the whole row's. Grouped-query heads run as
the kernel's multi-query form, one call per (row, kv head) with its H / K query heads
(`vmap`); q is scaled before the kernel, so dq is scaled after. A block's static mask is
causal (a rank's own block) or full (the zig-zag half blocks); packed rows' segment ids go
in as splash's `SegmentIds`. A query that sees no key of a block gets splash's lse of
`mask_value` + log(Sk) (about -2.4e38), or NaN o when the mask skipped all its key tiles: the
kernel returns o 0 and lse -inf for both.

Sliding windows: a window's offset between two zig-zag chunks depends on the ring step and
the rank, splash's masks are static, so `splash_kernel(window=W)` says `window=W` and the ring
gives it chunk pairs with a static `Band` each (`fsdp_jax.attention.windows`), as a
`LocalMask` (tiles wholly outside the band are skipped by splash's block-sparse grid).
Mosaic compiles the kernel for TPU only; `interpret=True` runs it anywhere
(slowly: CPU tests at small sizes). A block's tiles are the largest of `block`, `block` / 2,
... 128 that divides its length; the backward wants key tiles of a multiple of 128 tokens,
so half blocks (S / 2C) should be a multiple of 128.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fsdp_jax.attention.kernels import CAUSAL, FULL, Band, BlockKernel, as_band

BLOCK = 512


def _mask(band: Band, sq: int, sk: int):
    """Splash's static mask of a Band: CausalMask, FullMask, or a LocalMask with
    window_size (hi - 1, -lo) (query slot x sees keys x - (hi - 1) .. x + lo)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if band == CAUSAL:
        return sa.CausalMask((sq, sk))
    if band == FULL:
        return sa.FullMask((sq, sk))
    left = None if band.hi is None else band.hi - 1
    right = None if band.lo is None else -band.lo
    return sa.LocalMask((sq, sk), window_size=(left, right), offset=0)


@functools.lru_cache(maxsize=None)
def _kernel(sq: int, sk: int, heads: int, causal, softcap: float, interpret: bool, block: int):
    """What `make_splash_mqa_single_device(..., save_residuals=True)` builds, with the mask
    infos left as numpy (that factory makes jnp arrays: tracers when called under a trace,
    device arrays of whatever mesh is current), so one cached kernel serves every trace."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk_mod
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask_info as mi

    mask = sa.MultiHeadMask([_mask(as_band(causal), sq, sk)] * heads)
    bq, bkv = _fit(sq, block), _fit(sk, block)
    sizes = sa.BlockSizes(
        block_q=bq, block_kv=bkv, block_kv_compute=bkv, block_q_dkv=bq, block_kv_dkv=bkv,
        block_kv_dkv_compute=bkv, block_q_dq=bq, block_kv_dq=bkv,
    )  # fmt: skip
    fwd_info, mask_fn = mi.process_mask(mask, (bq, bkv))
    dq_info, _ = mi.process_mask(mask, (bq, bkv))
    dkv_info, _ = mi.process_mask_dkv(mask, (bq, bkv), shrink_grid=True)
    return sk_mod.SplashAttentionKernel(
        fwd_info,
        dq_info,
        dkv_info,
        block_sizes=sizes,
        is_mqa=True,
        save_residuals=True,
        mask_value=sk_mod.DEFAULT_MASK_VALUE,
        attn_logits_soft_cap=softcap or None,
        residual_checkpoint_name=None,
        mask_function=mask_fn,
        interpret=interpret,
    )


def _fit(length: int, block: int) -> int:
    """The largest of block, block / 2, ... (down to 128) that divides `length`; else `length`."""
    while block > 128 and length % block:
        block //= 2
    return block if length % block == 0 else length


def _grouped(x, kvh):
    """(B, S, H[, Dh]) -> (B, K, G, S[, Dh])."""
    b, s, h = x.shape[:3]
    return jnp.moveaxis(x.reshape(b, s, kvh, h // kvh, *x.shape[3:]), 1, 3)


def _ungrouped(x):
    """(B, K, G, S[, Dh]) -> (B, S, H[, Dh])."""
    b, kvh, g, s = x.shape[:4]
    return jnp.moveaxis(x, 3, 1).reshape(b, s, kvh * g, *x.shape[4:])


def _per_row_and_kv_head(fn, *args):
    """`fn` vmapped over kv heads (dim 1 of every arg but the (B, S) segment ids, which
    it shares) and rows (dim 0)."""
    axes = tuple(None if a.ndim == 2 else 0 for a in args)
    return jax.vmap(jax.vmap(fn, in_axes=axes))(*args)


def splash_kernel(
    *, scale: float, softcap: float = 0.0, window: int = 0, interpret: bool = False, block: int = BLOCK
) -> BlockKernel:
    """The splash `BlockKernel` (module docstring); with `window` the ring gives it chunk pairs
    and their bands (`ring_window`)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk_mod

    def prep(q, k, v):
        kvh = k.shape[2]
        qg = _grouped(q * jnp.asarray(scale, q.dtype), kvh)  # (B, K, G, Sq, Dh)
        return qg, jnp.moveaxis(k, 2, 1), jnp.moveaxis(v, 2, 1)  # (B, K, Sk, Dh)

    def fwd(q, k, v, qp, kp, qs, ks, local, causal):
        del qp, kp, local
        kern = _kernel(q.shape[1], k.shape[1], q.shape[2] // k.shape[2], causal, softcap, interpret, block)
        seg = sk_mod.SegmentIds

        def one(qh, kh, vh, qsg, ksg):
            o, (lse,) = kern(qh, kh, vh, segment_ids=seg(q=qsg, kv=ksg))
            return o, lse

        o, lse = _per_row_and_kv_head(one, *prep(q, k, v), qs, ks)
        o, lse = _ungrouped(o).astype(jnp.float32), _ungrouped(lse).astype(jnp.float32)
        # a query whose every key tile the block mask skips ends with l = 0: o NaN, lse -inf;
        # one inside a computed tile but seeing no key gets lse ~ mask_value: both see nothing
        seen = lse > sk_mod.DEFAULT_MASK_VALUE / 2
        return jnp.where(seen[..., None], o, 0.0), jnp.where(seen, lse, -jnp.inf)

    def bwd(q, k, v, qp, kp, qs, ks, local, o, lse, do, causal):
        del qp, kp, local
        kvh = k.shape[2]
        kern = _kernel(q.shape[1], k.shape[1], q.shape[2] // kvh, causal, softcap, interpret, block)
        kw = kern.kwargs

        def one(qh, kh, vh, oh, lh, doh, qsg, ksg):
            res = (qh, kh, vh, sk_mod.SegmentIds(q=qsg, kv=ksg), None, oh, lh, kern.dq_mask_info, kern.dkv_mask_info)
            grads = sk_mod._splash_attention_bwd(
                False,  # save_residuals
                kw["mask_value"],
                True,  # is_mqa
                kw["block_sizes"],
                None,  # residual_checkpoint_name
                kw["mask_function"],
                kw["attn_logits_soft_cap"],
                kw["interpret"],
                res,
                doh,
            )
            return grads[3:6]  # dq, dk, dv

        qg, kk, vv = prep(q, k, v)
        og, dog = _grouped(o.astype(q.dtype), kvh), _grouped(do.astype(q.dtype), kvh)
        lg = _grouped(lse.astype(jnp.float32), kvh)
        dq, dk, dv = _per_row_and_kv_head(one, qg, kk, vv, og, lg, dog, qs, ks)
        dq = _ungrouped(dq).astype(jnp.float32) * scale
        return dq, jnp.moveaxis(dk, 1, 2).astype(jnp.float32), jnp.moveaxis(dv, 1, 2).astype(jnp.float32)

    return BlockKernel(fwd, bwd, window=window)
