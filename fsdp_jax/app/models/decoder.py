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
from fsdp_jax.app.models.attention import softcap
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.lora import (
    LoraSpec,
    adapter_param_count,
    attach,
    delta,
)
from fsdp_jax.app.models.lora_dropout import layer_keys
from fsdp_jax.app.models.lora_problems import expert_dropout, target_problem
from fsdp_jax.app.models.moe import MoE, add_stats, moe_active_params, moe_params, zero_stats
from fsdp_jax.app.models.mtp import make_mtp, mtp_params, shift_left
from fsdp_jax.app.models.norm import RMSNorm, normal_param
from fsdp_jax.app.models.parts import DEFAULT_PARTS, BlockParts
from fsdp_jax.app.models.self_attention import Attention, attention_params, constrain, flat_rows, with_lora
from fsdp_jax.errors import ConfigError
from fsdp_jax.quant import fp8_modules
from fsdp_jax.quant.fp8_modules import project
from fsdp_jax.sharding.axes import BATCH, EMBED, LAYERS, LENGTH, MLP, VOCAB
from fsdp_jax.sharding.precision import matmul, take
from fsdp_jax.sharding.remat import get_policy
from fsdp_jax.train import layer_gather

FP8_WEIGHTS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")  # projections FP8 may compute


def embed_updates_layout():
    """A layout for the lookup's cotangent (B, S, D), D as the table's gradient (the axes EMBED
    maps to) and B over the batch axes EMBED leaves, when one of those has more than one device
    (hybrid_shard's `data`): left to the partitioner, a batch over data x fsdp meeting a table
    over fsdp and replicated over data was rematerialised whole on every device (issue 56 item
    3). None otherwise: under full_shard the partitioner's own path is the cheaper one."""
    rules = dict(nn.get_logical_axis_rules())
    embed = rules.get(EMBED)
    taken = set((embed,) if isinstance(embed, str) else embed or ())
    batch = rules.get(BATCH)
    left = tuple(a for a in ((batch,) if isinstance(batch, str) else batch or ()) if a not in taken)
    shape = jax.sharding.get_abstract_mesh().shape
    if not left or not taken or int(np.prod([shape.get(a, 1) for a in left])) == 1:
        return None
    first = ((EMBED, embed), (BATCH, left)) + tuple((n, a) for n, a in rules.items() if n not in (EMBED, BATCH))

    def lay_out(g):
        with nn.logical_axis_rules(first):
            return constrain(g, (BATCH, LENGTH, EMBED))

    return lay_out


class FeedForward(nnx.Module):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        self.w_gate = normal_param(rngs, (cfg.d_model, cfg.ffn_dim), (EMBED, MLP))
        self.w_up = normal_param(rngs, (cfg.d_model, cfg.ffn_dim), (EMBED, MLP))
        self.w_down = normal_param(rngs, (cfg.ffn_dim, cfg.d_model), (MLP, EMBED))
        self.gelu = cfg.mlp_activation == "gelu_pytorch_tanh"

    def __call__(self, x, dropout_key=None):  # (B, S, D)
        b, s, d = x.shape
        x2, k = flat_rows(x), dropout_key
        w_gate, w_up, w_down = self.w_gate[...], self.w_up[...], self.w_down[...]  # this layer's values
        g = with_lora(project(self, "w_gate", x2, w_gate, w_gate.shape), delta(self, "w_gate", x2, k))
        act = jax.nn.gelu(g, approximate=True) if self.gelu else jax.nn.silu(g)
        hid = act * with_lora(project(self, "w_up", x2, w_up, w_up.shape), delta(self, "w_up", x2, k))  # (B*S, F)
        hid = constrain(hid, (BATCH, MLP) if hid.ndim == 2 else (BATCH, LENGTH, MLP))
        out = with_lora(project(self, "w_down", hid, w_down, w_down.shape), delta(self, "w_down", hid, k))
        return checkpoint_name(out.reshape(b, s, d), "mlp_out")


class Block(nnx.Module):
    """One decoder layer; its MLP the mixture of experts when `sparse`. In an MoE model
    (`n_experts`) it returns (x, RouterStats), else x. `lora`: adapters on its projections;
    `fp8`: its attention and dense-MLP projections and its routed experts' GEMMs as scaled FP8
    matmuls (`fsdp_jax.quant.fp8`, `fp8_experts`)."""

    def __init__(
        self,
        cfg: DecoderConfig,
        rngs: nnx.Rngs,
        sparse: bool = False,
        lora: LoraSpec | None = None,
        parts: BlockParts = DEFAULT_PARTS,
        fp8=None,
    ):
        po = cfg.norm_plus_one
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
        self.attn = (parts.attention or Attention)(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
        if sparse:
            self.moe = (parts.moe or MoE)(cfg, rngs)
        else:
            self.mlp = (parts.mlp or FeedForward)(cfg, rngs)
        self.sparse, self.n_experts = sparse, cfg.n_experts
        self.sandwich = cfg.sandwich_norm
        if cfg.sandwich_norm:
            self.post_attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
            self.post_mlp_norm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
        fp8_modules.attach(self.attn, fp8, FP8_WEIGHTS)
        if sparse:  # the routed experts: per-expert scales (and histories: `fsdp_jax.quant.fp8_experts`)
            fp8_modules.attach_experts(self.moe, fp8, self.moe.fp8_expert_weights, cfg.n_experts)
        else:
            fp8_modules.attach(self.mlp, fp8, FP8_WEIGHTS)
        if lora is not None:  # last: the base params are drawn as without adapters
            attach(self, cfg, lora, rngs)

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
        if lora is not None and target_problem(cfg, lora):
            raise ConfigError(*target_problem(cfg, lora))
        if lora is not None and expert_dropout(cfg, lora):
            raise ConfigError("lora.dropout", expert_dropout(cfg, lora))
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
                attach(blk, cfg, lora, rngs)
        if cfg.mtp_depth:  # after every other param: the model's own are drawn as without MTP
            self.mtp = make_mtp(cfg, rngs, lambda c, r, sparse: Block(c, r, sparse, parts=parts, fp8=fp8))

    def __call__(
        self,
        tokens,
        segment_ids=None,
        positions=None,
        *,
        router: bool = False,
        token_mask=None,
        dropout_key=None,
        mtp: bool = False,
    ):
        """tokens (B, S) int -> logits (B, S, V). Packed rows: `segment_ids` (B, S) keep
        attention inside each example, `positions` (B, S) restart RoPE per example.
        `router`: return (logits, RouterStats over the tokens where `token_mask` (B, S)).
        `dropout_key`: the adapters' dropout (training; layer l's key `fold_in(key, l)`).
        `mtp` (`mtp_depth` > 0): logits become (logits, (depth 1's logits, ..., depth D's)),
        depth k's row i predicting token i + k + 1 (`models/mtp.py`; its blocks' router
        statistics join the model's)."""
        cfg = self.cfg
        x = self.embed_tokens(tokens)
        x0 = x  # the embeddings: MTP depth k reads them shifted by k
        if cfg.n_experts:
            x, stats = stack.run_layers(
                cfg, self.segments, x, self.remat, segment_ids, positions, token_mask, dropout_key
            )
            logits = self._head(x)
            if mtp:
                more, stats = self._mtp(x, x0, segment_ids, positions, token_mask, stats)
                logits = (logits, more)
            return (logits, stats) if router else logits
        pattern = bool(cfg.sliding_window and cfg.global_every)  # per-layer local flag
        # per layer (None: not used): the local flag, the adapters' dropout key
        flags = jnp.asarray([cfg.is_local(i) for i in range(cfg.n_layers)]) if pattern else None
        keys = layer_keys(dropout_key, cfg.n_layers)
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
        return (self._head(x), self._mtp(x, x0, segment_ids, positions)[0]) if mtp else self._head(x)

    def embed_tokens(self, tokens):  # (B, S) int -> (B, S, D): the embeddings the first layer takes
        cfg = self.cfg
        # Gather the table over its embed dim before the lookup, as for any FSDP
        # param; left sharded, the partitioner turns the gather into all-to-alls.
        emb = constrain(self.embed[...], (VOCAB, None))  # (V, D)
        x = take(emb, tokens, lambda g: constrain(g, (VOCAB, EMBED)), embed_updates_layout()).astype(emb.dtype)
        if cfg.embed_scale:  # sqrt(D) rounded to the compute dtype, as transformers does
            x = x * jnp.asarray(np.float32(cfg.d_model**0.5), emb.dtype)
        return constrain(x, (BATCH, LENGTH, EMBED))

    def _mtp(self, h, x0, segment_ids=None, positions=None, token_mask=None, stats=None):
        """The MTP depths' logits from the main model's last hidden `h` and embeddings `x0`
        (B, S, D): ((B, S, V) per depth, `stats` plus their blocks' router statistics)."""
        cfg = self.cfg
        if not cfg.mtp_depth:
            raise ConfigError("model.mtp_depth", "0: the model has no multi-token prediction modules")

        def fn(blk, x, loc):
            if cfg.n_experts:
                return blk(x, loc, segment_ids, positions, token_mask)
            return blk(x, loc, segment_ids, positions), None

        policy = layer_gather.block_policy(self.remat)
        fn = fn if policy is None else nnx.remat(fn, policy=policy)
        out = []
        for k, layer in enumerate(self.mtp, start=1):
            h, s = layer(h, shift_left(x0, k), fn)
            stats = stats if s is None else add_stats(stats, s)
            out.append(self._head(h, layer.norm))
        return tuple(out), stats

    def _head(self, x, norm=None):  # (B, S, D) -> logits (B, S, V); `norm`: an MTP depth's own
        cfg = self.cfg
        b, s, _ = x.shape
        x = (self.final_norm if norm is None else norm)(x)
        x2 = flat_rows(x)
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
    final norm; a family's block parts count theirs (`layer_params`, `added_params`); MTP depths
    their blocks and `mtp.mtp_params`. `active`: the experts a token uses (top-k of n_experts) only."""
    d, f = cfg.d_model, cfg.ffn_dim
    parts = families.block_parts(cfg)
    attn = getattr(parts.attention, "layer_params", attention_params)(cfg)
    added = getattr(parts.moe, "added_params", None)
    per_layer = attn + (4 if cfg.sandwich_norm else 2) * d
    layers = cfg.n_layers + cfg.mtp_depth  # an MTP depth's block is the block of its layer index
    n_sparse = sum(cfg.is_sparse(i) for i in range(layers))
    moe = (moe_active_params(cfg) if active else moe_params(cfg)) + (added(cfg, active) if added else 0)
    mlps = (layers - n_sparse) * 3 * d * f + n_sparse * moe
    tables = 1 if cfg.tie_word_embeddings else 2
    return tables * cfg.vocab_size * d + layers * per_layer + mlps + d + mtp_params(cfg)


def _attended_fraction(cfg: DecoderConfig, seq_len: int, layer: int) -> float:
    """Keys a causal query attends, summed over queries, relative to full causal."""
    w, s = cfg.sliding_window, seq_len
    if not cfg.is_local(layer) or w >= s:
        return 1.0
    return (w * (w + 1) / 2 + (s - w) * w) / (s * (s + 1) / 2)


def flops_per_token(cfg: DecoderConfig, seq_len: int, lora: LoraSpec | None = None) -> float:
    """Training FLOPs per token: 6 x (params used in matmuls: all but the embedding
    lookup) plus causal attention scores and values, 6 x L x S x H x Dh (PaLM appendix
    B counts 12 x L x S x D for full attention; causal masking does half the work; a
    sliding layer does the fraction of that work its window leaves; an MTP depth is one more
    layer and one more head matmul). With `lora` the base
    is frozen: 4 per base param (forward and input gradient, no weight gradient) plus 6
    per adapter param."""
    # a tied table is used by the head matmul, so only an untied one is lookup-only
    lookup_only = 0 if cfg.tie_word_embeddings else cfg.vocab_size * cfg.d_model
    # a token's experts only; each MTP depth runs the shared head once more
    matmul_params = count_params(cfg, active=True) - lookup_only + cfg.mtp_depth * cfg.vocab_size * cfg.d_model
    layers = sum(_attended_fraction(cfg, seq_len, i) for i in range(cfg.n_layers + cfg.mtp_depth))
    attention = 6.0 * layers * seq_len * cfg.n_heads * cfg.head_dim
    if lora is None:
        return 6.0 * matmul_params + attention
    return 4.0 * matmul_params + 6.0 * adapter_param_count(cfg, lora, active=True) + attention
