"""The decoder's attention kernels, apart from its modules: causal attention that never
crosses a packed row's segment boundary (XLA mask, or cuDNN's packed layout),
grouped-query attention with soft-capped scores, and the rotate-half RoPE on
explicit positions. Shapes: (B, S, H, Dh) for q/k/v, (B, S) segment ids.
`fsdp_jax.app.models.decoder` re-exports them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rope(x, positions, theta: float):
    """Rotary position embedding on (B, S, H, Dh), rotating halves; `positions` (S,) or
    (B, S) (packed rows: each example's positions restart at 0)."""
    dh = x.shape[-1]
    freqs = theta ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2 / dh)  # (Dh/2,)
    ang = positions[..., None].astype(jnp.float32) * freqs  # (S, Dh/2) or (B, S, Dh/2)
    ang = ang[None] if ang.ndim == 2 else ang  # (B|1, S, Dh/2)
    cos, sin = jnp.cos(ang)[:, :, None, :], jnp.sin(ang)[:, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


def softcap(x, cap: float):
    return x if not cap else jnp.tanh(x / cap) * cap


def attend_capped(q, k, v, scale, cap, mask):
    """Grouped-query attention with soft-capped scores (softmax in float32)."""
    b, s, h, dh = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, s, kvh, h // kvh, dh)
    sc = jnp.einsum("bskgd,btkd->bkgst", qg, k).astype(jnp.float32) * scale
    sc = jnp.where(mask[:, :, None] if mask.ndim == 4 else mask, softcap(sc, cap), -jnp.inf)
    p = jax.nn.softmax(sc, axis=-1).astype(v.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", p, v).reshape(b, s, h, dh)


def attend_sinks(q, k, v, sinks, scale, mask):
    """Grouped-query attention whose softmax denominator also holds a learned logit per head
    (an attention sink, gpt-oss): p_ij = exp(s_ij) / (sum_j' exp(s_ij') + exp(sink_h)), the
    sink taking the rest of the mass and giving no value; `sinks` None: plain softmax. q (B, S,
    H, Dh), k (B, T, K, Dh), v (B, T, K, Dv), sinks (H,), mask (1 | B, 1, S, T) bool; scores and
    softmax in float32 -> (B, S, H, Dv)."""
    b, s, h, dh = q.shape
    kvh = k.shape[2]
    qg = q.reshape(b, s, kvh, h // kvh, dh)
    sc = jnp.einsum("bskgd,btkd->bkgst", qg, k).astype(jnp.float32) * scale  # (B, K, G, S, T)
    sc = jnp.where(mask[:, :, None], sc, -jnp.inf)
    if sinks is None:
        p = jax.nn.softmax(sc, axis=-1).astype(v.dtype)
    else:
        sink = sinks.astype(jnp.float32).reshape(1, kvh, h // kvh, 1, 1)
        top = jnp.maximum(jnp.max(sc, axis=-1, keepdims=True), sink)  # finite: the sink is
        e = jnp.exp(sc - top)
        p = (e / (jnp.sum(e, axis=-1, keepdims=True) + jnp.exp(sink - top))).astype(v.dtype)
    return jnp.einsum("bkgst,btkd->bskgd", p, v).reshape(b, s, h, v.shape[-1])


def segment_mask(segment_ids):
    """(B, 1, S, S) bool: query i may attend to key j when both are in the same segment
    (causality is applied separately)."""
    return (segment_ids[:, :, None] == segment_ids[:, None, :])[:, None]


def packed_layout(segment_ids):
    """cuDNN's packed-sequence layout of segment ids (B, S) with segments numbered 1, 2, ...
    from the left (0 = padding, at the end): (seqlen (B, S), offsets (B, S + 1)), int32,
    -1 past each row's last segment (`jax._src.cudnn.fused_attention_stablehlo`)."""
    b, s = segment_ids.shape
    ids = jnp.arange(1, s + 1)  # a row holds at most S segments
    seqlen = jnp.sum(segment_ids[:, None, :] == ids[None, :, None], axis=-1)  # (B, S)
    offsets = jnp.concatenate([jnp.zeros((b, 1), jnp.int32), jnp.cumsum(seqlen, axis=-1).astype(jnp.int32)], axis=-1)
    used = jnp.concatenate([seqlen > 0, jnp.zeros((b, 1), bool)], axis=-1)
    offsets = jnp.where(used, offsets, -1)
    return jnp.where(seqlen > 0, seqlen, -1).astype(jnp.int32), offsets


def attention(q, k, v, segment_ids, impl: str):
    """Causal attention (B, S, H, Dh) that never crosses a segment boundary when
    `segment_ids` (B, S) is given. `xla`: a (B, 1, S, S) mask with is_causal.
    `cudnn`: jax.nn.dot_product_attention takes no segment ids, so the packed rows go to
    the cuDNN fused attention under it as per-row segment lengths and offsets
    (PADDING_CAUSAL, cuDNN's packed layout; GPU only: tests/test_packed_model.py emulates it),
    grouped-query K/V repeated to q's heads."""
    if segment_ids is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation=None if impl == "xla" else impl)
    if impl == "xla":
        return jax.nn.dot_product_attention(q, k, v, mask=segment_mask(segment_ids), is_causal=True)
    from jax._src.cudnn.fused_attention_stablehlo import MaskType
    from jax._src.cudnn.fused_attention_stablehlo import dot_product_attention as cudnn_attn

    seqlen, offsets = packed_layout(segment_ids)
    # jax 0.10's `_fix_seqlen_offsets` scales the K/V offsets by q's heads x head dim (0.12 by
    # K's own): grouped-query K/V repeated to q's heads read the right rows on both
    h = q.shape[2]
    k, v = (x if x.shape[2] == h else jnp.repeat(x, h // x.shape[2], axis=2) for x in (k, v))
    return cudnn_attn(
        q,
        k,
        v,
        q_seqlen=seqlen,
        kv_seqlen=seqlen,
        q_offsets=offsets,
        kv_offsets=offsets,
        scale=1.0 / q.shape[-1] ** 0.5,
        mask_type=MaskType.PADDING_CAUSAL,
    )
