"""Reference decoder in Flax NNX: Llama 2/3.x, Mistral, Qwen2.5, Qwen3 and Gemma 3 by config.

Token embedding (times sqrt(D) for Gemma) -> N x [RMSNorm -> causal self-attention
(grouped-query heads; optional q/k/v biases, per-head q/k RMSNorm, RoPE of
`models/rope.py`, sliding window on all layers or on a pattern of them, soft-capped
scores) -> (post-norm) -> residual; RMSNorm -> gated MLP (SiLU or tanh-GELU) ->
(post-norm) -> residual] -> RMSNorm -> output head (its own (D, V) param, or the
embedding table when `tie_word_embeddings`) -> (soft cap). Init normal(0, 0.02)
(biases too, and the w of `norm_plus_one`'s 1 + w), Llama norm scales 1. With every `DecoderConfig`
switch at its default this is the Llama-2 reference, param for param. The layout
matches Hugging Face's *ForCausalLM of each family up to transposes (rotate-half
RoPE, q head n uses kv head n // (H / K)); `fsdp_jax.app.hf.load` converts both ways.

Every parameter and activation names its dims with logical names from
`fsdp_jax.sharding.axes`; this module knows no mesh, strategy or optimizer. Params arrive
already cast to the compute dtype by the train step, so activations follow them.
A layer pattern (`global_every`) passes a per-layer "sliding" flag through the
layer scan, so scanned layers stay one module.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import linen as nn
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fsdp_jax.app.models import families, stack
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.attention import attend_capped, attention, rope, segment_mask, softcap
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.moe import MoE, moe_active_params, moe_params, zero_stats
from fsdp_jax.app.models.norm import RMSNorm, normal_param
from fsdp_jax.app.models.parts import DEFAULT_PARTS, BlockParts
from fsdp_jax.app.models.rope import apply_rope, rope_tables
from fsdp_jax.attention import RING_KERNELS, context_attention, flash_context_attention, splash_attention
from fsdp_jax.errors import ConfigError
from fsdp_jax.quant.fp8_modules import attach as attach_fp8
from fsdp_jax.quant.fp8_modules import project
from fsdp_jax.sharding.axes import BATCH, EMBED, HEADS, KV, KV_HEADS, LAYERS, LENGTH, MLP, VOCAB
from fsdp_jax.sharding.context import context_size
from fsdp_jax.sharding.precision import matmul, take
from fsdp_jax.sharding.remat import get_policy
from fsdp_jax.train import layer_gather

FP8_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # projections FP8 may compute


def constrain(x, names):
    """Activation sharding constraint by logical names (a no-op outside a mesh + rules context)."""
    return nn.with_logical_constraint(x, names)


def _rows(x):
    """(B, S, D) -> (B*S, D): flat rows, XLA:CPU's fast matmul path (docs/design.md); kept
    (B, S, D) when the sequence is split over `context` (merging two sharded dims moves data)."""
    return x if context_size() > 1 else x.reshape(-1, x.shape[-1])


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

    def _rope(self, q, k, s, local, positions):  # q, k: (B, S, H, Dh); positions: (B, S) or None
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

    def __call__(self, x, local=None, segment_ids=None, positions=None, dropout_key=None):
        # x: (B, S, D); local: this layer slides (pattern only); segment_ids, positions: (B, S);
        # dropout_key: the layer's key for its adapters' dropout (models/lora.py), None = off
        cfg = self.cfg
        b, s, d = x.shape
        x2 = _rows(x)

        def proj(name, w, bias=None):  # (D, H, Dh) -> (B, S, H, Dh)
            _, hh, dh = w.shape
            y = _plus(project(self, name, x2, w, (d, hh * dh)), lora_lib.delta(self, name, x2, dropout_key))
            y = y.reshape(b, s, hh, dh)
            if bias is not None:
                y = y + bias[...]
            return constrain(checkpoint_name(y, "qkv"), (BATCH, LENGTH, HEADS, KV))

        q = proj("wq", self.wq[...], self.bq if cfg.qkv_bias else None)
        k = proj("wk", self.wk[...], self.bk if cfg.qkv_bias else None)
        v = proj("wv", self.wv[...], self.bv if cfg.qkv_bias else None)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = self._rope(q, k, s, local, positions)
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        qi, ki = jnp.arange(s)[:, None], jnp.arange(s)[None, :]
        if context_size() > 1 and self.impl == "xla":  # sequence split over `context`, rows in zig-zag order
            kw = dict(softcap=cfg.attn_softcap, window=cfg.sliding_window, local=local)
            o = context_attention(q, k, v, positions, segment_ids, scale=scale, kv_pass=cfg.context_kv_pass, **kw)
        elif context_size() > 1:  # a flash kernel per ring block (splash on TPU, cuDNN on GPU)
            packed = {}  # cuDNN's packed layout per block, sized for a row's segments
            if self.impl == "cudnn":
                packed = {"packed": segment_ids is not None, "max_segments": cfg.max_segments}
            kern = RING_KERNELS[self.impl](scale=scale, softcap=cfg.attn_softcap, window=cfg.sliding_window, **packed)
            o = flash_context_attention(
                q, k, v, positions, segment_ids, kernel=kern, local=local, kv_pass=cfg.context_kv_pass
            )
        elif self.impl == "splash":  # TPU: Pallas flash attention (models/splash.py)
            kw = dict(softcap=cfg.attn_softcap, window=cfg.sliding_window, local=local)
            o = splash_attention(q, k, v, segment_ids, scale=scale, **kw)
        elif cfg.attn_softcap or local is not None or (segment_ids is not None and self.impl == "xla"):
            mask = ki <= qi
            if cfg.sliding_window:
                inside = qi - ki < cfg.sliding_window
                mask = mask & (inside if local is None else (inside | ~local))
            mask = mask[None, None] if segment_ids is None else mask[None, None] & segment_mask(segment_ids)
            if cfg.attn_softcap:
                o = attend_capped(q, k, v, scale, cfg.attn_softcap, mask)
            else:
                o = jax.nn.dot_product_attention(
                    q, k, v, mask=mask, scale=scale, implementation=None if self.impl == "xla" else self.impl
                )
        elif segment_ids is not None:  # cuDNN's packed layout: plain causal attention only
            if cfg.sliding_window or cfg.query_pre_attn_scalar:
                raise ValueError(
                    "model.attention=cudnn with packed rows computes plain causal attention "
                    "only (no sliding window or query_pre_attn_scalar); use model.attention=xla"
                )
            o = attention(q, k, v, segment_ids, self.impl)
        else:
            window = (cfg.sliding_window - 1, 0) if cfg.sliding_window else None
            o = jax.nn.dot_product_attention(
                q,
                k,
                v,
                is_causal=True,
                local_window_size=window,
                scale=None if not cfg.query_pre_attn_scalar else scale,
                implementation=None if self.impl == "xla" else self.impl,
            )
        wo = self.wo[...]
        o2 = _rows(o.reshape(b, s, -1))
        out = _plus(project(self, "wo", o2, wo, (-1, d)), lora_lib.delta(self, "wo", o2, dropout_key))  # (B*S, D)
        return checkpoint_name(out.reshape(b, s, d), "attn_out")


class FeedForward(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.w_gate = normal_param(rngs, (cfg.d_model, cfg.ffn_dim), (EMBED, MLP))
        self.w_up = normal_param(rngs, (cfg.d_model, cfg.ffn_dim), (EMBED, MLP))
        self.w_down = normal_param(rngs, (cfg.ffn_dim, cfg.d_model), (MLP, EMBED))
        self.gelu = cfg.mlp_activation == "gelu_pytorch_tanh"

    def __call__(self, x, dropout_key=None):  # (B, S, D)
        b, s, d = x.shape
        x2, k = _rows(x), dropout_key
        g = _plus(
            project(self, "w_gate", x2, self.w_gate[...], self.w_gate.shape), lora_lib.delta(self, "w_gate", x2, k)
        )
        act = jax.nn.gelu(g, approximate=True) if self.gelu else jax.nn.silu(g)
        hid = act * _plus(
            project(self, "w_up", x2, self.w_up[...], self.w_up.shape), lora_lib.delta(self, "w_up", x2, k)
        )
        hid = constrain(hid, (BATCH, MLP) if hid.ndim == 2 else (BATCH, LENGTH, MLP))
        out = _plus(
            project(self, "w_down", hid, self.w_down[...], self.w_down.shape), lora_lib.delta(self, "w_down", hid, k)
        )
        return checkpoint_name(out.reshape(b, s, d), "mlp_out")


def _plus(y, lora_delta):
    """A projection's output plus its LoRA adapter's term (`models/lora.py`), if any."""
    return y if lora_delta is None else y + lora_delta.astype(y.dtype)


class Block(nnx.Module):
    """One decoder layer; its MLP the mixture of experts when `sparse`. In an MoE model
    (`n_experts`) it returns (x, RouterStats), else x. `lora`: adapters on its projections;
    `fp8`: its attention and dense-MLP projections as scaled FP8 matmuls (`fsdp_jax.quant.fp8`)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        rngs: nnx.Rngs,
        sparse: bool = False,
        lora: lora_lib.LoraSpec | None = None,
        parts: BlockParts = DEFAULT_PARTS,
        fp8=None,
    ):
        po = cfg.norm_plus_one
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
        self.attn = (parts.attention or Attention)(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
        if sparse:
            self.moe = MoE(cfg, rngs)
        else:
            self.mlp = (parts.mlp or FeedForward)(cfg, rngs)
        self.sparse, self.n_experts = sparse, cfg.n_experts
        self.sandwich = cfg.sandwich_norm
        if cfg.sandwich_norm:
            self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
            self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
        for part in (self.attn,) if sparse else (self.attn, self.mlp):  # experts: not yet (docs/fp8.md)
            attach_fp8(part, fp8, FP8_WEIGHTS)
        if lora is not None:  # last: the base params are drawn as without adapters
            lora_lib.attach(self, cfg, lora, rngs)

    def __call__(self, x, local=None, segment_ids=None, positions=None, token_mask=None, dropout_key=None):
        x = constrain(x, (BATCH, LENGTH, EMBED))  # (B, S, D)
        a = self.attn(self.attn_norm(x), local, segment_ids, positions, dropout_key)
        x = x + (self.post_attn_norm(a) if self.sandwich else a)
        if self.sparse:
            m, stats = self.moe(self.mlp_norm(x), token_mask, dropout_key)
        else:
            m, stats = self.mlp(self.mlp_norm(x), dropout_key), zero_stats(self.n_experts)
        x = x + (self.post_mlp_norm(m) if self.sandwich else m)
        x = constrain(x, (BATCH, LENGTH, EMBED))
        return (x, stats) if self.n_experts else x


class Decoder(nnx.Module):
    """`Decoder(cfg, rngs=nnx.Rngs(0), remat="dots")(tokens (B, S) int) -> logits (B, S, V)`;
    optional `segment_ids` and `positions` (B, S) for packed rows; `lora` puts LoRA adapters
    on the projections it targets (`models/lora.py`); `parts` replaces a block's attention
    or MLP (`models/parts.py`; default: those of the family `cfg.family` names, `Family.parts`);
    `fp8` (an `fsdp_jax.quant.fp8.Fp8Recipe`): the blocks' projections in FP8 (not the head)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        *,
        rngs: nnx.Rngs,
        remat: str = "none",
        lora=None,
        parts: BlockParts | None = None,
        fp8=None,
    ):
        parts = families.block_parts(cfg) if parts is None else parts
        self.cfg = cfg
        self.remat = remat
        get_policy(remat)  # fail early on an unknown name
        self.embed = normal_param(rngs, (cfg.vocab_size, cfg.d_model), (VOCAB, EMBED))
        if lora is not None and lora_lib.target_problem(cfg, lora):
            raise ConfigError(*lora_lib.target_problem(cfg, lora))
        if lora is not None and lora_lib.expert_dropout(cfg, lora):
            raise ConfigError("lora.dropout", lora_lib.expert_dropout(cfg, lora))
        if cfg.n_experts:  # sparse and dense layers: stacked by segment
            self.segments = stack.make_layers(cfg, rngs, functools.partial(Block, parts=parts, fp8=fp8), lora)
        elif cfg.scan_layers:

            @nnx.split_rngs(splits=cfg.n_layers)
            @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
            def make(r):
                return Block(cfg, r, lora=lora, parts=parts, fp8=fp8)

            self.blocks = make(rngs)
        else:
            self.blocks = nnx.List([Block(cfg, rngs, parts=parts, fp8=fp8) for _ in range(cfg.n_layers)])
        self.final_norm = RMSNorm(cfg.d_model, cfg.norm_eps, cfg.norm_plus_one, rngs)
        if not cfg.tie_word_embeddings:
            self.head = normal_param(rngs, (cfg.d_model, cfg.vocab_size), (EMBED, VOCAB))
        if lora is not None and not cfg.scan_layers:  # last, as in a scanned Block
            for blk in self.segments if cfg.n_experts else self.blocks:
                lora_lib.attach(blk, cfg, lora, rngs)

    def __call__(
        self, tokens, segment_ids=None, positions=None, *, router: bool = False, token_mask=None, dropout_key=None
    ):
        """tokens (B, S) int -> logits (B, S, V). Packed rows: `segment_ids` (B, S) keep
        attention inside each example, `positions` (B, S) restart RoPE per example.
        `router`: return (logits, RouterStats over the tokens where `token_mask` (B, S)).
        `dropout_key`: the adapters' dropout (training; layer l's key `fold_in(key, l)`)."""
        cfg = self.cfg
        b, s = tokens.shape
        # Gather the table over its embed dim before the lookup, as for any FSDP
        # param; left sharded, the partitioner turns the gather into all-to-alls.
        emb = constrain(self.embed[...], (VOCAB, None))  # (V, D)
        x = take(emb, tokens, lambda g: constrain(g, (VOCAB, EMBED))).astype(emb.dtype)
        if cfg.embed_scale:  # sqrt(D) rounded to the compute dtype, as transformers does
            x = x * jnp.asarray(np.float32(cfg.d_model**0.5), emb.dtype)
        x = constrain(x, (BATCH, LENGTH, EMBED))
        if cfg.n_experts:
            x, stats = stack.run_layers(
                cfg, self.segments, x, self.remat, segment_ids, positions, token_mask, dropout_key
            )
            logits = self._head(x)
            return (logits, stats) if router else logits
        pattern = bool(cfg.sliding_window and cfg.global_every)  # per-layer local flag
        # per layer (None: not used): the local flag, the adapters' dropout key
        flags = jnp.asarray([cfg.is_local(i) for i in range(cfg.n_layers)]) if pattern else None
        keys = lora_lib.layer_keys(dropout_key, cfg.n_layers)
        # scanned layers: the train step's per-layer cast + gather (ZeRO-2/3, fsdp_jax.train.layer_gather)
        wrap = layer_gather.gather_module if cfg.scan_layers else (lambda blk: blk)

        def block_fn(blk, h, loc, key):
            return wrap(blk)(h, loc, segment_ids, positions, dropout_key=key)

        policy = layer_gather.block_policy(self.remat)
        if policy is not None:
            block_fn = nnx.remat(block_fn, policy=policy)
        if cfg.scan_layers:

            @nnx.scan(in_axes=(0, nnx.Carry, 0, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYERS})
            def run(blk, h, loc, key):
                return block_fn(blk, h, loc, key)

            x = run(self.blocks, x, flags, keys)
        else:
            for i, blk in enumerate(self.blocks):
                x = block_fn(blk, x, None if flags is None else flags[i], None if keys is None else keys[i])
        return self._head(x)

    def _head(self, x):  # (B, S, D) -> logits (B, S, V)
        cfg = self.cfg
        b, s, _ = x.shape
        x = self.final_norm(x)
        x2 = _rows(x)
        if cfg.tie_word_embeddings:
            logits = matmul(x2, self.embed[...].T).reshape(b, s, -1)  # (B*S, D) @ (D, V)
        else:
            logits = matmul(x2, self.head[...]).reshape(b, s, -1)
        return constrain(softcap(logits, cfg.final_softcap), (BATCH, LENGTH, VOCAB))


def cross_entropy(logits, targets):
    """Mean next-token cross-entropy in float32 (nats per token)."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def count_params(cfg: DecoderConfig, active: bool = False) -> int:
    """Parameter count: embeddings, head (unless tied), per-layer attention (+ q/k/v
    biases, q/k norms) + gated MLP or mixture of experts + 2 norms (4 with `sandwich_norm`),
    final norm. `active`: the experts a token uses (top-k of n_experts) only."""
    d, f, h, kvh = cfg.d_model, cfg.ffn_dim, cfg.n_heads, cfg.n_kv_heads
    dh = cfg.head_dim
    attn = d * h * dh + 2 * d * kvh * dh + h * dh * d
    attn += (h + 2 * kvh) * dh if cfg.qkv_bias else 0
    attn += 2 * dh if cfg.qk_norm else 0
    per_layer = attn + (4 if cfg.sandwich_norm else 2) * d
    n_sparse = sum(stack.sparse_layers(cfg))
    mlps = (cfg.n_layers - n_sparse) * 3 * d * f + n_sparse * (moe_active_params(cfg) if active else moe_params(cfg))
    tables = 1 if cfg.tie_word_embeddings else 2
    return tables * cfg.vocab_size * d + cfg.n_layers * per_layer + mlps + d


def _attended_fraction(cfg: DecoderConfig, seq_len: int, layer: int) -> float:
    """Keys a causal query attends, summed over queries, relative to full causal."""
    w, s = cfg.sliding_window, seq_len
    if not cfg.is_local(layer) or w >= s:
        return 1.0
    return (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)


def flops_per_token(cfg: DecoderConfig, seq_len: int, lora: lora_lib.LoraSpec | None = None) -> float:
    """Training FLOPs per token: 6 x (params used in matmuls: all but the embedding
    lookup) plus causal attention scores and values, 6 x L x S x H x Dh (PaLM appendix
    B counts 12 x L x S x D for full attention; causal masking does half the work; a
    sliding layer does the fraction of that work its window leaves). With `lora` the base
    is frozen: 4 per base param (forward and input gradient, no weight gradient) plus 6
    per adapter param."""
    # a tied table is used by the head matmul, so only an untied one is lookup-only
    lookup_only = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.d_model
    matmul_params = count_params(cfg, active=True) - lookup_only  # a token's experts only
    layers = sum(_attended_fraction(cfg, seq_len, i) for i in range(cfg.n_layers))
    attention = 6.0 * layers * seq_len * cfg.n_heads * cfg.head_dim
    if lora is None:
        return 6.0 * matmul_params + attention
    return 4.0 * matmul_params + 6.0 * lora_lib.adapter_param_count(cfg, lora, active=True) + attention
