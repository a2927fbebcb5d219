"""DeepSeek-V3's sparse MLP as a block part (`fsdp_jax.app.models.parts.BlockParts.moe`):
grouped sigmoid routing with a score-correction bias, and shared experts.

    GroupedMoE(cfg, rngs)(x (B, S, D), token_mask, dropout_key) -> (y (B, S, D), RouterStats)

The decoder's `MoE` (its experts, dispatch, capacity, expert parallelism, statistics) with:
- scores s = sigmoid(x W_router) (float32); the choice scores s + b (`score_bias`, transformers'
  `e_score_correction_bias`) pick the experts: the experts fall in `n_group` groups, a group
  scores the sum of its best two choice scores, a token keeps its `topk_group` best groups and
  takes its top-k experts among theirs; the weights are those experts' s (not s + b),
  renormalised over the k when `norm_topk_prob`, times `routed_scaling_factor`;
- `score_bias` takes no gradient (DeepSeek updates it by the aux-loss-free balancing rule,
  not by the loss; this decoder keeps it as imported);
- shared experts, one gated MLP of width `shared_experts_ffn_dim` (n_shared_experts x
  moe_intermediate_size) on every token, added unscaled.
LoRA: the shared experts' adapters (`shared_lora`, PEFT's mlp.shared_experts.{gate,up,down}_proj) are
added to their projections, as on Qwen2-MoE's shared expert; the routed experts take adapters only as
`lora.target_parameters` names them (PEFT's mlp.experts.gate_up_proj / down_proj), as Mixtral's; the
router's (`router_lora`, lora.targets `gate`: PEFT's mlp.gate.weight) is added to its logits.
The router statistics' probabilities are the sigmoid scores normalised per token (so the
load-balancing metric reads as for a softmax router: k when balanced). New params and their logical
dims: `score_bias` (E,) `expert`; `shared_gate`, `shared_up` (embed, mlp), `shared_down`
(mlp, embed).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fsdp_jax.app.models.lora import ROUTER, delta
from fsdp_jax.app.models.moe import MoE
from fsdp_jax.app.models.moe_dispatch import gated, per_token_shard
from fsdp_jax.app.models.norm import normal_param
from fsdp_jax.sharding.axes import EMBED, EXPERT, MLP


def group_top_k(scores, choice, k: int, n_group: int, topk_group: int, norm: bool, factor: float):
    """scores, choice (N, E) -> (scores normalised per token (N, E): the router statistics'
    probabilities, as DeepSeek-V3's sequence-wise balance loss normalises them; weights (N, k);
    experts (N, k) int32), the experts from each token's `topk_group` best groups of `n_group`
    (a group's score: its best two choices)."""
    n, e = choice.shape
    grouped = choice.reshape(n, n_group, e // n_group)
    group_score = jnp.sum(jax.lax.top_k(grouped, 2)[0], axis=-1)  # (N, G)
    _, best = jax.lax.top_k(group_score, topk_group)  # (N, topk_group)
    keep = jnp.zeros((n, n_group), bool).at[jnp.arange(n)[:, None], best].set(True)
    masked = jnp.where(jnp.repeat(keep, e // n_group, axis=1), choice, -jnp.inf)
    _, idx = jax.lax.top_k(masked, k)
    w = jnp.take_along_axis(scores, idx, axis=-1)
    if norm:
        w = w / (jnp.sum(w, axis=-1, keepdims=True) + 1e-20)
    return scores / jnp.sum(scores, axis=-1, keepdims=True), w * factor, idx.astype(jnp.int32)


class GroupedMoE(MoE):
    expert_lora = True  # its routed experts take adapters only as named (`fsdp_jax.app.models.lora.own_experts`)

    def make_experts(self, cfg, rngs: nnx.Rngs) -> None:
        super().make_experts(cfg, rngs)
        d, fs = cfg.d_model, cfg.shared_experts_ffn_dim
        self.score_bias = normal_param(rngs, (cfg.n_experts,), (EXPERT,))
        self.shared_gate = normal_param(rngs, (d, fs), (EMBED, MLP))
        self.shared_up = normal_param(rngs, (d, fs), (EMBED, MLP))
        self.shared_down = normal_param(rngs, (fs, d), (MLP, EMBED))
        self.groups = (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor)

    def router_logits(self, x2):
        logits = super().router_logits(x2)  # (N, E) f32, plus the router's adapter term (PEFT's mlp.gate.weight)
        term = delta(self, ROUTER, x2, where="router_lora")
        return logits if term is None else logits + term.astype(jnp.float32)

    def route_tokens(self, logits):
        scores = jax.nn.sigmoid(logits)  # (N, E) float32
        choice = scores + jax.lax.stop_gradient(self.score_bias[...]).astype(jnp.float32)
        g, tg, factor = self.groups
        return per_token_shard(
            lambda s, c: group_top_k(s, c, self.k, g, tg, self.norm_topk_prob, factor), scores, choice
        )

    def __call__(self, x, token_mask=None, dropout_key=None):
        y, stats = super().__call__(x, token_mask, dropout_key)
        b, s, d = x.shape
        x2, proj, k = x.reshape(b * s, d), self.shared_proj, dropout_key  # each with its adapter's term, if any
        h = gated(proj(x2, "w_gate", self.shared_gate, k), proj(x2, "w_up", self.shared_up, k))
        return y + proj(h, "w_down", self.shared_down, k).reshape(b, s, d).astype(y.dtype), stats

    @staticmethod
    def added_params(cfg, active: bool = False) -> int:
        """Params one layer of it has beyond `moe_params`: the score bias and the shared experts."""
        return cfg.n_experts + 3 * cfg.d_model * cfg.shared_experts_ffn_dim
