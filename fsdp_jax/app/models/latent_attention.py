"""Multi-head latent attention (DeepSeek-V2 / V3) as a block part
(`fsdp_jax.app.models.parts.BlockParts.attention`).

    LatentAttention(cfg, rngs)(x (B, S, D), local, segment_ids, positions, dropout_key) -> (B, S, D)

q = RMSNorm(x W_qa) W_qb (`q_lora_rank` r_q; 0: x W_q), per head [q_nope (Dn), q_rope (Dr)];
[c (r_kv), k_rope (Dr)] = x W_kva, one RoPE key shared by every head (the decoupled key);
[k_nope (Dn), v (Dv)] = RMSNorm(c) W_kvb per head; RoPE (`rope_type`, YaRN for V3) on q_rope
and k_rope, their dims interleaved in pairs as DeepSeek's weights lay them out
(transformers' `rope_interleave`); softmax scale (Dn + Dr)^-0.5, times mscale(factor,
mscale_all_dim)^2 under YaRN; causal (packed segments kept apart); o = attn W_o. XLA only:
`model.attention` other than xla and context parallelism are refused in one line.

Dims: Dr = `head_dim` (`qk_rope_head_dim`), Dn = `qk_nope_head_dim`, Dv = `v_head_dim`. Params
and their logical dims: `wq_a` (embed, q_lora), `q_a_norm`, `wq_b` (q_lora, heads, kv) (or `wq`
(embed, heads, kv)), `wkv_a` (embed, kv_lora), `kv_a_norm`, `wkv_b` (kv_lora, heads, kv),
`wo` (heads, kv, embed). LoRA adapters (`models/lora.py`) on the five projections by PEFT's
names (q_a_proj, q_b_proj or q_proj, kv_a_proj_with_mqa, kv_b_proj, o_proj; `lora_dims`), each
added to its projection's output (the norms and the RoPE split act on the sums, as in PEFT).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fsdp_jax.app.models.attention import attend_sinks
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.lora import delta
from fsdp_jax.app.models.norm import RMSNorm, normal_param
from fsdp_jax.app.models.rope import apply_rope, rope_tables
from fsdp_jax.app.models.self_attention import causal_mask, constrain, flat_rows, with_lora
from fsdp_jax.errors import ConfigError
from fsdp_jax.sharding.axes import BATCH, EMBED, HEADS, KV, KV_LORA, LENGTH, Q_LORA
from fsdp_jax.sharding.context import context_size
from fsdp_jax.sharding.precision import matmul


def softmax_scale(cfg: DecoderConfig) -> float:
    """(Dn + Dr)^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 (transformers' yarn_apply_mscale)."""
    scale = (cfg.qk_nope_head_dim + cfg.head_dim) ** -0.5
    if cfg.rope_type == "yarn" and cfg.rope_mscale_all_dim and cfg.rope_factor > 1:
        m = 0.1 * cfg.rope_mscale_all_dim * math.log(cfg.rope_factor) + 1.0
        scale *= m * m
    return scale


def deinterleave(x):
    """(..., Dr) in pairs (x0, x1), (x2, x3), ... -> (evens, odds): rotate-half's layout."""
    return jnp.concatenate([x[..., 0::2], x[..., 1::2]], axis=-1)


class LatentAttention(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        d, h, dr = cfg.d_model, cfg.n_heads, cfg.head_dim
        dn, dv, rq, rkv = cfg.qk_nope_head_dim, cfg.v_head_dim, cfg.q_lora_rank, cfg.kv_lora_rank
        if rq:
            self.wq_a = normal_param(rngs, (d, rq), (EMBED, Q_LORA))
            self.q_a_norm = RMSNorm(rq, cfg.norm_eps, False, rngs)
            self.wq_b = normal_param(rngs, (rq, h, dn + dr), (Q_LORA, HEADS, KV))
        else:
            self.wq = normal_param(rngs, (d, h, dn + dr), (EMBED, HEADS, KV))
        self.wkv_a = normal_param(rngs, (d, rkv + dr), (EMBED, KV_LORA))
        self.kv_a_norm = RMSNorm(rkv, cfg.norm_eps, False, rngs)
        self.wkv_b = normal_param(rngs, (rkv, h, dn + dv), (KV_LORA, HEADS, KV))
        self.wo = normal_param(rngs, (h, dv, d), (HEADS, KV, EMBED))
        self.cfg = cfg

    def __call__(self, x, local=None, segment_ids=None, positions=None, dropout_key=None):
        cfg = self.cfg
        if cfg.attention != "xla" or context_size() > 1:
            raise ConfigError(
                "model.attention", f"{cfg.attention}: latent attention is computed by xla only (mesh.context 1)"
            )
        b, s, d = x.shape
        h, dr, dn, rkv = cfg.n_heads, cfg.head_dim, cfg.qk_nope_head_dim, cfg.kv_lora_rank
        x2 = flat_rows(x)  # (B*S, D)

        def proj(name, rows, w):  # rows @ w (flattened to 2-D) plus its adapter's term
            return with_lora(matmul(rows, w.reshape(rows.shape[-1], -1)), delta(self, name, rows, dropout_key))

        if cfg.q_lora_rank:
            q = proj("wq_b", self.q_a_norm(proj("wq_a", x2, self.wq_a[...])), self.wq_b[...])
        else:
            q = proj("wq", x2, self.wq[...])
        q = constrain(checkpoint_name(q.reshape(b, s, h, dn + dr), "qkv"), (BATCH, LENGTH, HEADS, KV))
        ckv = proj("wkv_a", x2, self.wkv_a[...])  # (B*S, r_kv + Dr): the latent and the shared RoPE key
        kv = proj("wkv_b", self.kv_a_norm(ckv[:, :rkv]), self.wkv_b[...]).reshape(b, s, h, -1)
        kv = constrain(checkpoint_name(kv, "qkv"), (BATCH, LENGTH, HEADS, KV))
        cos, sin = rope_tables(cfg, s)  # (S, Dr/2)
        if positions is not None:  # packed rows: each example's positions restart at 0
            cos, sin = cos[positions], sin[positions]
        q_rope = apply_rope(deinterleave(q[..., dn:]), cos, sin)
        k_rope = apply_rope(deinterleave(ckv[:, rkv:].reshape(b, s, 1, dr)), cos, sin)
        q = jnp.concatenate([q[..., :dn], q_rope], axis=-1)  # (B, S, H, Dn + Dr)
        k = jnp.concatenate([kv[..., :dn], jnp.broadcast_to(k_rope, (b, s, h, dr)).astype(kv.dtype)], axis=-1)
        o = attend_sinks(q, k, kv[..., dn:], None, softmax_scale(cfg), causal_mask(cfg, s, local, segment_ids))
        out = proj("wo", flat_rows(o.reshape(b, s, -1)), self.wo[...])  # (B, S, H, Dv) -> (B*S, D)
        return checkpoint_name(out.reshape(b, s, d), "attn_out")

    @staticmethod
    def lora_dims(cfg) -> dict[str, tuple]:
        """{weight: (input shape, input names, output shape, output names)} of the projections
        adapters may go on (`lora.weight_dims`'s form)."""
        d, h, dr, dn, dv = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        if rq:
            q = {"wq_a": ((d,), (EMBED,), (rq,), (Q_LORA,)), "wq_b": ((rq,), (Q_LORA,), (h, dn + dr), (HEADS, KV))}
        else:
            q = {"wq": ((d,), (EMBED,), (h, dn + dr), (HEADS, KV))}
        return {
            **q,
            "wkv_a": ((d,), (EMBED,), (rkv + dr,), (KV_LORA,)),
            "wkv_b": ((rkv,), (KV_LORA,), (h, dn + dv), (HEADS, KV)),
            "wo": ((h, dv), (HEADS, KV), (d,), (EMBED,)),
        }

    @staticmethod
    def layer_params(cfg) -> int:
        """One layer's attention params (the count `decoder.count_params` takes)."""
        d, h, dr, dn, dv = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
        rq, rkv = cfg.q_lora_rank, cfg.kv_lora_rank
        q = (d * rq + rq + rq * h * (dn + dr)) if rq else d * h * (dn + dr)
        return q + d * (rkv + dr) + rkv + rkv * h * (dn + dv) + h * dv * d
