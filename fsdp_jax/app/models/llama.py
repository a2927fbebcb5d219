"""Reference Llama-style decoder in Flax NNX.

Token embedding -> N x [RMSNorm -> causal self-attention (RoPE, grouped-query
heads, no biases) -> residual; RMSNorm -> SwiGLU MLP -> residual] -> RMSNorm ->
output head (its own (D, V) param, or the embedding table when
`tie_word_embeddings`). Init normal(0, 0.02), norm scales 1. The layout matches
Hugging Face's LlamaForCausalLM up to transposes (rotate-half RoPE, q head n uses
kv head n // (H / K)); `fsdp_jax.app.hf` converts both ways.

Every parameter and activation names its dims with logical names from
`fsdp_jax.axes`; this module knows no mesh, strategy or optimizer. Params arrive
already cast to the compute dtype by the train step, so activations follow them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import linen as nn
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fsdp_jax.axes import BATCH, EMBED, HEADS, KV, KV_HEADS, LAYERS, LENGTH, MLP, NORM, VOCAB
from fsdp_jax import layer_gather
from fsdp_jax.remat import get_policy


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 256
    d_model: int = 256
    n_layers: int = 4
    n_heads: int = 4
    n_kv_heads: int = 4
    ffn_dim: int = 704
    max_seq_len: int = 128
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    scan_layers: bool = True
    attention: str = "xla"  # xla | cudnn (jax.nn.dot_product_attention implementation)
    tie_word_embeddings: bool = False  # output head = embed.T (no separate head param)

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads


def constrain(x, names):
    """Activation sharding constraint by logical names (a no-op outside a mesh + rules context)."""
    return nn.with_logical_constraint(x, names)


_init = nnx.initializers.normal(0.02)


def _param(rngs: nnx.Rngs, shape, names):
    return nnx.Param(nnx.with_partitioning(_init, names)(rngs.params(), shape))


class RMSNorm(nnx.Module):
    def __init__(self, dim: int, eps: float):
        self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, (NORM,))(None, (dim,)))
        self.eps = eps

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)


def rope(x, positions, theta: float):
    """Rotary position embedding on (B, S, H, Dh), rotating halves."""
    dh = x.shape[-1]
    freqs = theta ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2 / dh)  # (Dh/2,)
    ang = positions[:, None].astype(jnp.float32) * freqs[None, :]  # (S, Dh/2)
    cos, sin = jnp.cos(ang)[None, :, None, :], jnp.sin(ang)[None, :, None, :]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        d, h, kvh, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.wq = _param(rngs, (d, h, dh), (EMBED, HEADS, KV))
        self.wk = _param(rngs, (d, kvh, dh), (EMBED, KV_HEADS, KV))
        self.wv = _param(rngs, (d, kvh, dh), (EMBED, KV_HEADS, KV))
        self.wo = _param(rngs, (h, dh, d), (HEADS, KV, EMBED))
        self.theta = cfg.rope_theta
        self.impl = cfg.attention

    def __call__(self, x):  # x: (B, S, D)
        b, s, d = x.shape
        x2 = x.reshape(b * s, d)  # flat rows: XLA:CPU's fast matmul path (DESIGN.md)

        def proj(w):  # (D, H, Dh) -> (B, S, H, Dh)
            _, hh, dh = w.shape
            y = (x2 @ w.reshape(d, hh * dh)).reshape(b, s, hh, dh)
            return constrain(checkpoint_name(y, "qkv"), (BATCH, LENGTH, HEADS, KV))

        pos = jnp.arange(s)
        q = rope(proj(self.wq[...]), pos, self.theta)
        k = rope(proj(self.wk[...]), pos, self.theta)
        v = proj(self.wv[...])
        o = jax.nn.dot_product_attention(q, k, v, is_causal=True,
                                         implementation=None if self.impl == "xla" else self.impl)
        wo = self.wo[...]
        out = o.reshape(b * s, -1) @ wo.reshape(-1, d)  # (B*S, D)
        return checkpoint_name(out.reshape(b, s, d), "attn_out")


class FeedForward(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.w_gate = _param(rngs, (cfg.d_model, cfg.ffn_dim), (EMBED, MLP))
        self.w_up = _param(rngs, (cfg.d_model, cfg.ffn_dim), (EMBED, MLP))
        self.w_down = _param(rngs, (cfg.ffn_dim, cfg.d_model), (MLP, EMBED))

    def __call__(self, x):  # (B, S, D)
        b, s, d = x.shape
        x2 = x.reshape(b * s, d)
        hid = jax.nn.silu(x2 @ self.w_gate[...]) * (x2 @ self.w_up[...])  # (B*S, F)
        hid = constrain(hid, (BATCH, MLP))
        return checkpoint_name((hid @ self.w_down[...]).reshape(b, s, d), "mlp_out")


class Block(nnx.Module):
    def __init__(self, cfg: LlamaConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = FeedForward(cfg, rngs)

    def __call__(self, x):  # (B, S, D) -> (B, S, D)
        x = constrain(x, (BATCH, LENGTH, EMBED))
        x = x + self.attn(self.attn_norm(x))
        x = x + self.mlp(self.mlp_norm(x))
        return constrain(x, (BATCH, LENGTH, EMBED))


class Llama(nnx.Module):
    """`Llama(cfg, rngs=nnx.Rngs(0), remat="dots")(tokens (B, S) int) -> logits (B, S, V)`."""

    def __init__(self, cfg: LlamaConfig, *, rngs: nnx.Rngs, remat: str = "none"):
        self.cfg = cfg
        self.remat = remat
        get_policy(remat)  # fail early on an unknown name
        self.embed = _param(rngs, (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED))
        if cfg.scan_layers:
            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
            def make(r):
                return Block(cfg, r)
            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        if not cfg.tie_word_embeddings:
            self.head = _param(rngs, (cfg.d_model, cfg.vocab_size), (EMBED, VOCAB))

    def __call__(self, tokens):
        b, s = tokens.shape
        # Gather the table over its embed dim before the lookup, as for any FSDP
        # param; left sharded, the partitioner turns the gather into all-to-alls.
        emb = constrain(self.embed[...], (VOCAB, None))  # (V, D)
        x = jnp.take(emb, tokens, axis=0).astype(emb.dtype)  # (B, S, D)
        x = constrain(x, (BATCH, LENGTH, EMBED))
        block_fn = (lambda blk, h: blk(h))
        if self.cfg.scan_layers:  # the train step's per-layer cast + gather (ZeRO-2/3)
            block_fn = (lambda blk, h: layer_gather.gather_module(blk)(h))
        policy = layer_gather.block_policy(self.remat)
        if policy is not None:
            block_fn = nnx.remat(block_fn, policy=policy)
        if self.cfg.scan_layers:
            @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry,
                      transform_metadata={nnx.PARTITION_NAME: LAYERS})
            def run(blk, h):
                return block_fn(blk, h)
            x = run(self.blocks, x)
        else:
            for blk in self.blocks:
                x = block_fn(blk, x)
        x = self.final_norm(x)
        x2 = x.reshape(b * s, -1)
        if self.cfg.tie_word_embeddings:
            logits = (x2 @ self.embed[...].T).reshape(b, s, -1)  # (B*S, D) @ (D, V)
        else:
            logits = (x2 @ self.head[...]).reshape(b, s, -1)
        return constrain(logits, (BATCH, LENGTH, VOCAB))


def cross_entropy(logits, targets):
    """Mean next-token cross-entropy in float32 (nats per token)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def count_params(cfg: LlamaConfig) -> int:
    """Parameter count: embeddings, head (unless tied), per-layer attention + SwiGLU + 2 norms,
    final norm."""
    d, f, h, kvh = cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads
    dh = cfg.head_dim
    attn = d * h * dh + 2 * d * kvh * dh + h * dh * d
    per_layer = attn + 3 * d * f + 2 * d
    tables = 1 if cfg.tie_word_embeddings else 2
    return tables * cfg.vocab_size * d + cfg.n_layers * per_layer + d


def flops_per_token(cfg: LlamaConfig, seq_len: int) -> float:
    """Training FLOPs per token: 6 x (params used in matmuls: all but the embedding
    lookup) plus causal attention scores and values, 6 x L x S x D (PaLM appendix B
    counts 12 x L x S x D for full attention; causal masking does half the work)."""
    # a tied table is used by the head matmul, so only an untied one is lookup-only
    lookup_only = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.d_model
    matmul_params = count_params(cfg) - lookup_only
    return 6.0 * matmul_params + 6.0 * cfg.n_layers * seq_len * cfg.d_model


def sample(next_logits, prompt, n_new: int, window: int, rng, temperature: float = 0.8) -> list[int]:
    """Temperature sampling of `n_new` tokens after `prompt` (1-D ints).

    `next_logits(buf (window,) int32, pos) -> logits (V,)` scores the token after
    position `pos - 1` of a fixed-size window (which slides once full), so one
    compiled forward serves every step."""
    import numpy as np

    toks = [int(t) for t in np.asarray(prompt)][-window:]
    out: list[int] = []
    for i in range(n_new):
        ctx = (toks + out)[-window:]
        buf = np.zeros((window,), np.int32)
        buf[:len(ctx)] = ctx
        logits = np.asarray(next_logits(buf, len(ctx)), np.float64) / max(temperature, 1e-6)
        key = jax.random.fold_in(rng, i)
        out.append(int(jax.random.categorical(key, jnp.asarray(logits))))
    return out
