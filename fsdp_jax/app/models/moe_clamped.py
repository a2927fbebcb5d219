"""The sparse MLP of gpt-oss as a block part (`fsdp_jax.app.models.parts.BlockParts.moe`):
a router with a bias, experts with biases and a clamped SwiGLU.

    ClampedMoE(cfg, rngs)(x (B, S, D), token_mask, dropout_key) -> (y (B, S, D), RouterStats)

The decoder's `MoE` (dispatch, expert parallelism, capacity, router statistics) with:
- router logits x W_router + b_router; the top-k of them, weights softmax over those k (the
  same as the top-k of softmax(logits) renormalised: `norm_topk_prob`);
- each expert: h = x W_gate_up + b_gate_up (E, D, 2F) with gate and up INTERLEAVED on the
  last dim, as transformers' `GptOssExperts.gate_up_proj` holds them (gate = h[..., ::2],
  up = h[..., 1::2]); gate = min(gate, limit), up = clip(up, -limit, limit);
  y = ((up + 1) * gate * sigmoid(alpha * gate)) W_down + b_down (`swiglu_limit`, `swiglu_alpha`).
New params and their logical dims: `router_bias` (E,) `expert`; `w_gate_up` (E, D, 2F)
`expert, embed, mlp`; `b_gate_up` (E, 2F) `expert, mlp`; `w_down` (E, F, D) `expert, mlp,
embed`; `b_down` (E, D) `expert, embed`. LoRA on these experts only as `lora.target_parameters`
names them (PEFT's `mlp.experts.gate_up_proj` / `down_proj`; `expert_lora`): `experts_gate_up`'s term
is added to x W_gate_up before the bias and the split (its columns interleaved as the weight's),
`experts_down`'s to a W_down.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fsdp_jax.app.models.moe import MoE
from fsdp_jax.app.models.norm import normal_param
from fsdp_jax.sharding.axes import EMBED, EXPERT, MLP


class ClampedMoE(MoE):
    expert_lora = True  # its experts take adapters, only as named (`fsdp_jax.app.models.lora.own_experts`)
    fp8_expert_weights = ("w_gate_up", "w_down")

    def make_experts(self, cfg, rngs: nnx.Rngs) -> None:
        d, e, f = cfg.d_model, cfg.n_experts, cfg.moe_ffn_dim
        self.router_bias = normal_param(rngs, (e,), (EXPERT,))
        self.w_gate_up = normal_param(rngs, (e, d, 2 * f), (EXPERT, EMBED, MLP))
        self.b_gate_up = normal_param(rngs, (e, 2 * f), (EXPERT, MLP))
        self.w_down = normal_param(rngs, (e, f, d), (EXPERT, MLP, EMBED))
        self.b_down = normal_param(rngs, (e, d), (EXPERT, EMBED))
        self.limit, self.alpha = cfg.swiglu_limit, cfg.swiglu_alpha

    def router_logits(self, x2):
        return super().router_logits(x2) + self.router_bias[...].astype(jnp.float32)

    def _experts(self):
        return self.with_adapters([self.w_gate_up[...], self.w_down[...], self.b_gate_up[...], self.b_down[...]])

    def expert_ffn(self, x, ws, lora, dot, rows):
        wgu, wd, bgu, bd = ws[:4]
        pairs = dict(zip(lora.parts, zip(ws[4::2], ws[5::2]))) if lora else {}

        def plus(y, x, name):  # y plus the adapter's (x A) B * scale, two thin products
            if name not in pairs:
                return y
            t = dot(dot(x, pairs[name][0]), pairs[name][1])
            return y + t * jnp.asarray(lora.scale, t.dtype)

        h = plus(dot(x, wgu), x, "experts_gate_up")
        h = h + rows(bgu).astype(h.dtype)  # (rows, 2F) or (E, C, 2F)
        gate, up = jnp.minimum(h[..., ::2], self.limit), jnp.clip(h[..., 1::2], -self.limit, self.limit)
        a = (up + 1) * gate * jax.nn.sigmoid(gate * self.alpha)
        y = plus(dot(a, wd), a, "experts_down")
        return y + rows(bd).astype(y.dtype)

    @staticmethod
    def added_params(cfg, active: bool = False) -> int:
        """Params one layer of it has beyond `moe_params` (`active`: a token's): the biases."""
        e = cfg.experts_per_token if active else cfg.n_experts
        return cfg.n_experts + e * (2 * cfg.moe_ffn_dim + cfg.d_model)
