"""The decoder's self-attention module, in steps a block part may replace one by one.

    Attention(cfg, rngs)(x (B, S, D), local, segment_ids, positions, dropout_key) -> (B, S, D)

Steps: `project` (q/k/v projections (+ biases, LoRA terms, per-head q/k norms) -> (B, S, H,
Dh)), `rotate` (RoPE of `models/rope.py`, the sliding layers of a pattern on their own
base), `attend` (causal grouped-query attention: XLA, cuDNN or splash, context-parallel
rings, sliding windows, soft caps) and `output` (o projection). A family's attention variant
(`fsdp_jax.app.models.parts.BlockParts.attention`, e.g. attention sinks) subclasses this and
overrides the step it changes; `fsdp_jax.app.models.decoder` builds its blocks from it.
Every parameter and activation names its dims with logical names (`fsdp_jax.sharding.axes`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fsdp_jax.app.models.attention import attend_capped, attention, rope, segment_mask
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.lora import delta
from fsdp_jax.app.models.norm import RMSNorm, normal_param
from fsdp_jax.app.models.rope import apply_rope, rope_tables
from fsdp_jax.attention import RING_KERNELS, context_attention, flash_context_attention, splash_attention
from fsdp_jax.quant import fp8_modules
from fsdp_jax.sharding.axes import BATCH, EMBED, HEADS, KV, KV_HEADS, LENGTH
from fsdp_jax.sharding.context import context_size


def constrain(x, names):
    """Activation sharding constraint by logical names (a no-op outside a mesh + rules context)."""
    return nn.with_logical_constraint(x, names)


def flat_rows(x):
    """(B, S, D) -> (B*S, D): flat rows, XLA:CPU's fast matmul path (docs/design.md); kept
    (B, S, D) when the sequence is split over `context` (merging two sharded dims moves data)."""
    return x if context_size() > 1 else x.reshape(-1, x.shape[-1])


def with_lora(y, lora_delta):
    """A projection's output plus its LoRA adapter's term (`models/lora.py`), if any."""
    return y if lora_delta is None else y + lora_delta.astype(y.dtype)


def causal_mask(cfg: DecoderConfig, s: int, local, segment_ids):
    """(1 | B, 1, S, S) bool: causal, inside the sliding window where the layer slides
    (`local` None: every layer, when `cfg.sliding_window`), inside each packed segment."""
    qi, ki = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
    mask = ki <= qi
    if cfg.sliding_window:
        inside = qi - ki < cfg.sliding_window
        mask = mask & (inside if local is None else (inside | ~local))
    return mask[None, None] if segment_ids is None else mask[None, None] & segment_mask(segment_ids)


def attention_params(cfg: DecoderConfig) -> int:
    """One layer's params of `Attention`: q/k/v/o projections (+ q/k/v biases, q/k norms)."""
    d, h, kvh, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    n = d * h * dh + 2 * d * kvh * dh + h * dh * d
    n += (h + 2 * kvh) * dh if cfg.qkv_bias else 0
    return n + (2 * dh if cfg.qk_norm else 0)


class Attention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, h, kvh, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = normal_param(rngs, (d, h, dh), (EMBED, HEADS, KV))
        self.wk = normal_param(rngs, (d, kvh, dh), (EMBED, KV_HEADS, KV))
        self.wv = normal_param(rngs, (d, kvh, dh), (EMBED, KV_HEADS, KV))
        self.wo = normal_param(rngs, (h, dh, d), (HEADS, KV, EMBED))
        if cfg.qkv_bias:  # drawn like the weights: softmax ignores a per-query constant, so
            # a k bias gets tiny gradients (RoPE aside) and from zero would move by noise
            self.bq = normal_param(rngs, (h, dh), (HEADS, KV))
            self.bk = normal_param(rngs, (kvh, dh), (KV_HEADS, KV))
            self.bv = normal_param(rngs, (kvh, dh), (KV_HEADS, KV))
        if cfg.qk_norm:
            self.q_norm = RMSNorm(dh, cfg.norm_eps, cfg.norm_plus_one, rngs)
            self.k_norm = RMSNorm(dh, cfg.norm_eps, cfg.norm_plus_one, rngs)
        self.cfg = cfg
        self.impl = cfg.attention

    def rotate(self, q, k, s, local, positions):  # q, k: (B, S, H, Dh); positions: (B, S) or None
        cfg = self.cfg
        if cfg.rope_type == "default" and not cfg.global_every:
            pos = jnp.arange(s) if positions is None else positions  # (S,) or (B, S)
            return rope(q, pos, cfg.rope_theta), rope(k, pos, cfg.rope_theta)
        cos, sin = rope_tables(cfg, s)
        if local is not None:
            lc, ls = rope_tables(cfg, s, local=True)
            cos, sin = jnp.where(local, lc, cos), jnp.where(local, ls, sin)
        if positions is not None:  # packed rows: each example's positions restart at 0
            cos, sin = cos[positions], sin[positions]  # (B, S, Dh/2)
        return apply_rope(q, cos, sin), apply_rope(k, cos, sin)

    def project(self, x, dropout_key=None):
        """x (B, S, D) -> q (B, S, H, Dh), k, v (B, S, K, Dh): projections, biases, q/k norms."""
        cfg = self.cfg
        b, s, d = x.shape
        x2 = flat_rows(x)

        def proj(name, w, bias=None):  # (D, H, Dh) -> (B, S, H, Dh)
            _, hh, dh = w.shape
            y = with_lora(fp8_modules.project(self, name, x2, w, (d, hh * dh)), delta(self, name, x2, dropout_key))
            y = y.reshape(b, s, hh, dh)
            if bias is not None:
                y = y + bias[...]
            return constrain(checkpoint_name(y, "qkv"), (BATCH, LENGTH, HEADS, KV))

        q = proj("wq", self.wq[...], self.bq if cfg.qkv_bias else None)
        k = proj("wk", self.wk[...], self.bk if cfg.qkv_bias else None)
        v = proj("wv", self.wv[...], self.bv if cfg.qkv_bias else None)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return q, k, v

    def attend(self, q, k, v, local=None, segment_ids=None, positions=None):
        """Causal attention of q (B, S, H, Dh) over k, v (B, S, K, Dh) -> (B, S, H, Dh)."""
        cfg = self.cfg
        s = q.shape[1]
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        if context_size() > 1 and self.impl == "xla":  # sequence split over `context`, rows in zig-zag order
            kw = dict(softcap=cfg.attn_softcap, window=cfg.sliding_window, local=local)
            return context_attention(q, k, v, positions, segment_ids, scale=scale, kv_pass=cfg.context_kv_pass, **kw)
        if context_size() > 1:  # a flash kernel per ring block (splash on TPU, cuDNN on GPU)
            packed = {}  # cuDNN's packed layout per block, sized for a row's segments
            if self.impl == "cudnn":
                packed = {"packed": segment_ids is not None, "max_segments": cfg.max_segments}
            kern = RING_KERNELS[self.impl](scale=scale, softcap=cfg.attn_softcap, window=cfg.sliding_window, **packed)
            return flash_context_attention(
                q, k, v, positions, segment_ids, kernel=kern, local=local, kv_pass=cfg.context_kv_pass
            )
        if self.impl == "splash":  # TPU: Pallas flash attention (models/splash.py)
            kw = dict(softcap=cfg.attn_softcap, window=cfg.sliding_window, local=local)
            return splash_attention(q, k, v, segment_ids, scale=scale, **kw)
        if cfg.attn_softcap or local is not None or (segment_ids is not None and self.impl == "xla"):
            mask = causal_mask(cfg, s, local, segment_ids)
            if cfg.attn_softcap:
                return attend_capped(q, k, v, scale, cfg.attn_softcap, mask)
            return jax.nn.dot_product_attention(
                q, k, v, mask=mask, scale=scale, implementation=None if self.impl == "xla" else self.impl
            )
        if segment_ids is not None:  # cuDNN's packed layout: plain causal attention only
            if cfg.sliding_window or cfg.query_pre_attn_scalar:
                raise ValueError(
                    "model.attention=cudnn with packed rows computes plain causal attention "
                    "only (no sliding window or query_pre_attn_scalar); use model.attention=xla"
                )
            return attention(q, k, v, segment_ids, self.impl)
        window = (cfg.sliding_window - 1, 0) if cfg.sliding_window else None
        return jax.nn.dot_product_attention(
            q,
            k,
            v,
            is_causal=True,
            local_window_size=window,
            scale=None if not cfg.query_pre_attn_scalar else scale,
            implementation=None if self.impl == "xla" else self.impl,
        )

    def output(self, o, dropout_key=None):
        """o (B, S, H, Dh) -> (B, S, D) through the o projection (+ its LoRA term)."""
        b, s, _, _ = o.shape
        wo = self.wo[...]
        d = wo.shape[-1]
        o2 = flat_rows(o.reshape(b, s, -1))
        out = with_lora(
            fp8_modules.project(self, "wo", o2, wo, (-1, d)), delta(self, "wo", o2, dropout_key)
        )  # (B*S, D)
        return out.reshape(b, s, d)

    def __call__(self, x, local=None, segment_ids=None, positions=None, dropout_key=None):
        # x: (B, S, D); local: this layer's sliding flag (scalar bool) or None; segment_ids / positions: (B, S);
        # dropout_key: the layer's key for its adapters' dropout (models/lora.py), None = off
        q, k, v = self.project(x, dropout_key)
        q, k = self.rotate(q, k, x.shape[1], local, positions)
        o = self.attend(q, k, v, local, segment_ids, positions)
        return checkpoint_name(self.output(o, dropout_key), "attn_out")
