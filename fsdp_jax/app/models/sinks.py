"""Attention with a learned sink logit per head and an o-projection bias (gpt-oss), as a
block part (`fsdp_jax.app.models.parts.BlockParts.attention`).

    SinkAttention(cfg, rngs)(x (B, S, D), local, segment_ids, positions, dropout_key) -> (B, S, D)

The decoder's `Attention` (q/k/v projections with their biases: `qkv_bias`; LoRA terms) with
three steps of its own:
- `attend`: each head's softmax denominator holds one more logit, the head's `sinks` entry
  (`models/attention.attend_sinks`): the attention weights of a query sum to less than 1.
  Causal, inside the window on sliding layers (`local`), inside packed segments. XLA only:
  no flash kernel here takes the sink (`model.attention` other than xla and context
  parallelism are refused, one line);
- `rotate`: every layer rotates alike (the RoPE of `rope_type`, YaRN for gpt-oss): sliding
  layers have no base of their own;
- `output`: the o projection plus its bias `bo`.
New params and their logical dims: `sinks` (H,) `heads`, `bo` (D,) `embed`.
"""

from __future__ import annotations

from flax import nnx

from fsdp_jax.app.models.attention import attend_sinks
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.norm import normal_param
from fsdp_jax.app.models.self_attention import Attention, attention_params, causal_mask
from fsdp_jax.errors import ConfigError
from fsdp_jax.sharding.axes import EMBED, HEADS
from fsdp_jax.sharding.context import context_size


class SinkAttention(Attention):
    def __init__(self, cfg: DecoderConfig, rngs: nnx.Rngs):
        super().__init__(cfg, rngs)
        self.sinks = normal_param(rngs, (cfg.n_heads,), (HEADS,))
        self.bo = normal_param(rngs, (cfg.d_model,), (EMBED,))

    def rotate(self, q, k, s, local, positions):
        return super().rotate(q, k, s, None, positions)  # one RoPE for sliding and full layers

    def attend(self, q, k, v, local=None, segment_ids=None, positions=None):
        cfg = self.cfg
        if self.impl != "xla":
            raise ConfigError("model.attention", f"{self.impl}: attention sinks are computed by xla only")
        if context_size() > 1:
            raise ConfigError("mesh.context", f"{context_size()}: attention sinks have no context-parallel kernel (1)")
        scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
        return attend_sinks(q, k, v, self.sinks[...], scale, causal_mask(cfg, q.shape[1], local, segment_ids))

    def output(self, o, dropout_key=None):
        out = super().output(o, dropout_key)  # (B, S, D)
        return out + self.bo[...].astype(out.dtype)

    @staticmethod
    def layer_params(cfg) -> int:
        """One layer's attention params: the decoder's attention's, the sinks and the o bias."""
        return attention_params(cfg) + cfg.n_heads + cfg.d_model
