"""The decoder's mixture-of-experts MLP (Mixtral, Qwen3-MoE, Qwen2-MoE by config).

Router: logits = x @ router (D, E), p = softmax(logits) in float32, the top-k experts of p
per token with weights p (renormalised over the k when `norm_topk_prob`, as Mixtral and
Qwen3-MoE do; Qwen2-MoE uses them as they are). Each expert is a gated MLP
(SiLU(x W_gate) * x W_up) W_down with its own (E, D, F) weights. Qwen2-MoE adds a shared
expert (a dense gated MLP) scaled per token by sigmoid(x w_shared_gate).

Two ways to compute the experts, both from the same weights (`models/moe_dispatch.py`, which
also places them on the mesh: tokens routed where they are, experts split by the rules):
- dropless (`capacity_factor` 0, the default): the N * k (token, expert) pairs sorted by
  expert and run as grouped matmuls with the per-expert group sizes (`models/grouped_matmul.py`:
  `jax.lax.ragged_dot`, or tokamax's kernels on GPU).
  Every token reaches its k experts.
- capacity (`capacity_factor` c > 0): each expert takes at most C = ceil(c * N * k / E)
  tokens, in token order (the first to claim it win, as GShard / Switch); the pairs over
  capacity are dropped (their weight is 0; the residual carries the token) and counted.
  Tokens are gathered into an (E, C, D) buffer and the experts are batched matmuls over
  it, so compute is c * k / E of the dense all-experts form on every backend.

Each sparse layer returns router statistics summed over its tokens (`RouterStats`), from
which `aux_loss` is transformers' load-balancing loss (`load_balancing_loss_func`) pooled
over all sparse layers. Params name logical dims only (`expert` among them).
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from fsdp_jax.app.models.grouped_matmul import lowering_platform, resolve
from fsdp_jax.app.models.lora import delta
from fsdp_jax.app.models.moe_dispatch import (
    ExpertLora,
    dropless,
    experts_ffn,
    fp8_dot,
    gated,
    per_batch_shard,
    per_token_shard,
    with_capacity,
)
from fsdp_jax.app.models.moe_exchange import exchange_capacity, exchange_dropless, exchange_dropless_ragged
from fsdp_jax.app.models.moe_problems import moe_config_problem  # noqa: F401  (re-exported)
from fsdp_jax.errors import ConfigError
from fsdp_jax.quant import fp8_expert_gather, fp8_experts, fp8_modules
from fsdp_jax.sharding.axes import EMBED, EXPERT, MLP
from fsdp_jax.sharding.precision import matmul


class RouterStats(NamedTuple):
    """Router statistics summed over the (masked) tokens of the sparse layers so far:
    `counts` (E,) sum_t m_t #{top-k of t = e}, `probs` (E,) sum_t m_t p_te, `tokens`
    sum_t m_t, `z` sum_t m_t logsumexp(logits_t)^2, `dropped` (token, expert) pairs over
    capacity, `layers` the number of sparse layers summed; `seq_balance` the layers' sum of
    DeepSeek-V3's sequence-wise balance term (`seq_balance`); `layer_counts` (L, E) each layer's
    own `counts` in its row (the layer stack fills it, `add_layer`; None from one block):
    the per-layer loads of the aux-loss-free balancing rule (`app.trainer.expert_bias`)."""

    counts: jax.Array
    probs: jax.Array
    tokens: jax.Array
    z: jax.Array
    dropped: jax.Array
    layers: jax.Array
    seq_balance: jax.Array | None = None
    layer_counts: jax.Array | None = None


def zero_stats(n_experts: int, n_layers: int = 0) -> RouterStats:
    """Zero statistics; with `n_layers`, per-layer counts (n_layers, n_experts) too."""
    z = jnp.zeros((), jnp.float32)
    e = jnp.zeros((n_experts,), jnp.float32)
    per_layer = jnp.zeros((n_layers, n_experts), jnp.float32) if n_layers else None
    return RouterStats(e, e, z, z, z, z, z, per_layer)


def add_stats(a: RouterStats, b: RouterStats) -> RouterStats:
    """The sums of two statistics, field by field (a field None on one side: the other's)."""
    return RouterStats(*(y if x is None else x if y is None else x + y for x, y in zip(a, b)))


def add_layer(stats: RouterStats, s: RouterStats, layer) -> RouterStats:
    """`stats` plus one block's `s`, whose counts also go to row `layer` (an int, or a traced
    index inside the layer scan) of `stats.layer_counts`."""
    out = add_stats(stats, s)
    return out._replace(layer_counts=out.layer_counts.at[layer].add(s.counts))


def seq_balance(p, hits, m, rows: int, k: int) -> jax.Array:
    """One layer's sequence-wise balance term (DeepSeek-V3 report eq. 18-20, before alpha): the
    mean over the `rows` sequences of sum_e f_e P_e, with f_e = E / (k T) x the row's tokens
    routed to e and P_e = the row's mean of p_e, T its (masked) tokens. `p` (N, E) the router's
    probabilities (softmax, or the per-token normalised sigmoid scores), `hits` (N, E) 1 where
    a token's top-k took e, `m` (N,) the token mask; N = rows x S. Balanced: 1 (a row of no
    tokens: 0). The gradient flows through P only."""
    e = p.shape[-1]
    mm = m.reshape(rows, -1, 1)  # (B, S, 1)
    t = jnp.maximum(jnp.sum(mm, axis=1), 1.0)  # (B, 1)
    f = e / (k * t) * jnp.sum(mm * hits.reshape(rows, -1, e), axis=1)  # (B, E)
    pe = jnp.sum(mm * p.reshape(rows, -1, e), axis=1) / t  # (B, E)
    return jnp.mean(jnp.sum(jax.lax.stop_gradient(f) * pe, axis=-1))


def aux_loss(s: RouterStats) -> jax.Array:
    """transformers' load-balancing loss: E * sum_e f_e P_e, f_e and P_e the masked means
    over every sparse layer's tokens of the top-k assignment counts and the router
    probabilities (a balanced router gives k)."""
    n = jnp.maximum(s.tokens, 1.0)
    return s.counts.shape[0] * jnp.sum((s.counts / n) * (s.probs / n))


def z_loss(s: RouterStats) -> jax.Array:
    """Router z-loss (ST-MoE): the masked mean over tokens and sparse layers of logsumexp(logits)^2."""
    return s.z / jnp.maximum(s.tokens, 1.0)


def expert_load(s: RouterStats) -> jax.Array:
    """Fraction of the routed (token, expert) pairs each expert received, (E,); sums to 1."""
    return s.counts / jnp.maximum(jnp.sum(s.counts), 1.0)


_init = nnx.initializers.normal(0.02)


def _param(rngs: nnx.Rngs, shape, names):
    return nnx.Param(nnx.with_partitioning(_init, names)(rngs.params(), shape))


def route(logits, k: int, norm_topk_prob: bool):
    """(N, E) router logits -> (softmax probs (N, E) f32, top-k weights (N, k) f32, top-k
    experts (N, k) int32)."""
    p = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    w, idx = jax.lax.top_k(p, k)
    if norm_topk_prob:
        w = w / jnp.sum(w, axis=-1, keepdims=True)
    return p, w, idx.astype(jnp.int32)


def capacity(n_tokens: int, k: int, n_experts: int, factor: float) -> int:
    """Tokens each expert takes in capacity mode: ceil(factor * N * k / E), at most N."""
    return max(1, min(n_tokens, math.ceil(factor * n_tokens * k / n_experts)))


class MoE(nnx.Module):
    """The sparse MLP of one layer: `(x (B, S, D), token_mask (B, S) or None) -> (y (B, S, D),
    RouterStats)`. Config fields used: d_model, n_experts, experts_per_token, moe_ffn_dim,
    norm_topk_prob, shared_expert_ffn_dim, capacity_factor, grouped_matmul, expert_exchange."""

    # the expert weights `expert_ffn` multiplies by `dot`, first in `_experts`' order (FP8
    # histories per expert under the delayed recipe: `fp8_modules.attach_experts`)
    fp8_expert_weights: tuple[str, ...] = ("w_gate", "w_up", "w_down")

    def __init__(self, cfg, rngs: nnx.Rngs):
        d, e = cfg.d_model, cfg.n_experts
        self.router = _param(rngs, (d, e), (EMBED, None))
        self.make_experts(cfg, rngs)
        if cfg.shared_expert_ffn_dim:
            fs = cfg.shared_expert_ffn_dim
            self.shared_gate = _param(rngs, (d, fs), (EMBED, MLP))
            self.shared_up = _param(rngs, (d, fs), (EMBED, MLP))
            self.shared_down = _param(rngs, (fs, d), (MLP, EMBED))
            self.shared_weight = _param(rngs, (d, 1), (EMBED, None))
        self.k = cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob
        self.shared = bool(cfg.shared_expert_ffn_dim)
        self.capacity_factor = cfg.capacity_factor
        self.grouped_matmul = cfg.grouped_matmul
        self.expert_exchange = cfg.expert_exchange

    def make_experts(self, cfg, rngs: nnx.Rngs) -> None:
        """The experts' params (a family's sparse MLP part, `BlockParts.moe`, makes its own)."""
        d, e, f = cfg.d_model, cfg.n_experts, cfg.moe_ffn_dim
        self.w_gate = _param(rngs, (e, d, f), (EXPERT, EMBED, MLP))
        self.w_up = _param(rngs, (e, d, f), (EXPERT, EMBED, MLP))
        self.w_down = _param(rngs, (e, f, d), (EXPERT, MLP, EMBED))

    def router_logits(self, x2):
        """Rows x2 (N, D) -> router logits (N, E) float32."""
        return matmul(x2, self.router[...]).astype(jnp.float32)

    def route_tokens(self, logits):
        """Router logits (N, E) f32 -> (probabilities (N, E), top-k weights (N, k), experts (N, k))."""
        return per_token_shard(lambda lg: route(lg, self.k, self.norm_topk_prob), logits)

    def expert_ffn(self, x, ws, lora, dot, rows):
        """The experts on rows `x` (`moe_dispatch.experts_ffn`'s signature; `ws` from `_experts`)."""
        return experts_ffn(x, ws, lora, dot, rows)

    def _experts(self):
        """(the expert weights, then each adapter's A and B (`EXPERT_ADAPTERS` order); the
        `ExpertLora` saying which, or None without adapters)."""
        return self.with_adapters([self.w_gate[...], self.w_up[...], self.w_down[...]])

    def with_adapters(self, ws: list):
        """(`ws` (the expert tensors) then each expert adapter's A and B; `ExpertLora` or None)."""
        adapters = getattr(self, "lora", None)
        if adapters is None:
            return tuple(ws), None
        parts = tuple(n for n in ("experts_gate_up", "experts_down") if n in adapters)
        for n in parts:
            ws += [adapters[n].lora_a[...], adapters[n].lora_b[...]]
        return tuple(ws), ExpertLora(parts, adapters[parts[0]].scale)

    def __call__(self, x, token_mask=None, dropout_key=None):
        # dropout_key: the layer's, for its shared expert's adapters (models/lora.py)
        b, s, d = x.shape
        x2 = x.reshape(b * s, d)  # (N, D)
        logits = self.router_logits(x2)  # (N, E)
        p, w, idx = self.route_tokens(logits)
        experts, lora = self._experts()
        cf, ffn, specs = self.capacity_factor, self.expert_ffn, ()
        if fp8_modules.recipe_of(self) is not None:  # the experts' GEMMs in FP8 (`moe_dispatch.fp8_dot`)
            hists = fp8_modules.expert_histories(self, self.fp8_expert_weights) or ()
            experts = (*experts, *hists)  # delayed: travel (and shard) with the expert weights
            gathers = self._fp8_gathers(experts) or ()
            specs = tuple(spec for spec, _ in gathers)  # those weights enter as their at-rest shards
            ffn = functools.partial(
                _fp8_ffn, self.expert_ffn, self.fp8_expert_weights, len(hists), tuple(g for _, g in gathers),
                fp8_modules.recipe_of(self).rowwise,
            )  # fmt: skip

        n_experts = experts[0].shape[0]

        def compute(x2, w, idx, *rest):  # the tokens of one batch shard, experts from e0
            *ws, e0 = rest
            if cf:
                cap = capacity(x2.shape[0], self.k, n_experts, cf)
                return with_capacity(x2, w, idx, ws, cap, n_experts, e0, lora, ffn)
            return dropless(x2, w, idx, ws, e0, lora, self.grouped_matmul, ffn)

        def exchange(x2, w, idx, *rest):  # experts over batch axes: all-to-all
            *ws, axes, n_ep = rest
            if cf:
                cap = capacity(x2.shape[0], self.k, n_experts, cf)
                return exchange_capacity(x2, w, idx, ws, axes, n_ep, cap, n_experts, lora, ffn)
            if self.expert_exchange == "ragged":
                if lowering_platform() == "cpu":
                    raise ConfigError("model.expert_exchange", "ragged: XLA:CPU has no ragged-all-to-all; use dense")
                return exchange_dropless_ragged(x2, w, idx, ws, axes, n_ep, lora, self.grouped_matmul, ffn)
            return exchange_dropless(x2, w, idx, ws, axes, n_ep, lora, self.grouped_matmul, ffn)

        y, dropped = per_batch_shard(compute, (x2, w, idx), experts, exchange, specs)
        if self.shared:
            y = y + self._shared(x2, dropout_key)
        m = jnp.ones((b * s,), jnp.float32) if token_mask is None else token_mask.reshape(-1).astype(jnp.float32)
        e = p.shape[-1]
        hits = jnp.sum(jax.nn.one_hot(idx, e, dtype=jnp.float32), axis=1)  # (N, E)
        lse = jax.nn.logsumexp(logits, axis=-1)
        one = jnp.ones((), jnp.float32)
        stats = RouterStats(
            m @ hits, m @ p, jnp.sum(m), jnp.sum(m * lse * lse), dropped, one, seq_balance(p, hits, m, b, self.k)
        )
        y = checkpoint_name(y.astype(x.dtype).reshape(b, s, d), "mlp_out")
        return y, stats

    def _fp8_gathers(self, experts):
        """(at-rest spec, gather) of each FP8 expert weight when `fp8.gather` casts them on their
        shards and all-gathers f8 (`fsdp_jax.quant.fp8_expert_gather`): under full_shard /
        hybrid_shard, with the per-expert tensor scales or the rowwise recipe's per-column and
        per-row scales, where the FP8 products run (capacity mode, or XLA's grouped matmul:
        tokamax's kernels stay in the compute dtype). None otherwise."""
        recipe = fp8_modules.recipe_of(self)
        if not recipe.gather:
            return None
        if not self.capacity_factor and resolve(self.grouped_matmul) != "xla":
            return None
        return fp8_expert_gather.expert_gathers(self, self.fp8_expert_weights, experts)

    def shared_proj(self, x, name: str, w, key):
        """Rows x @ the shared expert's weight `w` (its decoder name `name`: w_gate ...) plus its
        adapter's term (`shared_lora`, LoRA; `key` the layer's dropout key), if any."""
        y = matmul(x, w[...])
        d = delta(self, name, x, key, where="shared_lora")
        return y if d is None else y + d.astype(y.dtype)

    def _shared(self, x2, key):
        """The shared expert on rows x2 (N, D), scaled by sigmoid(x2 w_shared_gate)."""
        proj = self.shared_proj
        hs = gated(proj(x2, "w_gate", self.shared_gate, key), proj(x2, "w_up", self.shared_up, key))
        gate = jax.nn.sigmoid(proj(x2, "w_shared_gate", self.shared_weight, key))  # (N, 1)
        return gate * proj(hs, "w_down", self.shared_down, key)


def _fp8_ffn(ffn, names: tuple[str, ...], n_hist: int, gathers: tuple, rowwise: bool, x, ws, lora, dot, rows):
    """`ffn` through FP8 expert products (`rowwise` scales or per-expert tensor scales); the
    first weights of `ws` are those `names` (`fp8_expert_weights`) names; the last `n_hist` of
    `ws` their delayed histories, and `gathers` their f8 gathers (or ()), paired with them
    (`fp8_experts.ExpertWeight`)."""
    if n_hist:
        ws, hs = ws[:-n_hist], ws[-n_hist:]
    else:
        hs = (None,) * len(names)
    gs = gathers or ((),) * len(names)
    wrapped = (fp8_experts.ExpertWeight(w, h, g) for w, h, g in zip(ws, hs, gs))
    return ffn(x, (*wrapped, *ws[len(names) :]), lora, fp8_dot(dot, rowwise), rows)


def moe_params(cfg) -> int:
    """Params of one sparse MLP: router, E experts, shared expert and its gate."""
    d, fs = cfg.d_model, cfg.shared_expert_ffn_dim
    return d * cfg.n_experts + 3 * cfg.n_experts * d * cfg.moe_ffn_dim + (3 * d * fs + d if fs else 0)


def moe_active_params(cfg) -> int:
    """Params of one sparse MLP a token uses: router, k experts, shared expert and its gate."""
    d, fs = cfg.d_model, cfg.shared_expert_ffn_dim
    return d * cfg.n_experts + 3 * cfg.experts_per_token * d * cfg.moe_ffn_dim + (3 * d * fs + d if fs else 0)
