"""Qwen3: Llama's layers with RMSNorms over head_dim on q and k (before RoPE), no biases."""

from fsdp_jax.app.models.families import qwen2
from fsdp_jax.app.models.families.llama import DEFAULTS
from fsdp_jax.app.models.families.registry import Family

QK_NORM_NAMES = {
    "attn/q_norm/scale": ("self_attn.q_norm.weight", "id"),
    "attn/k_norm/scale": ("self_attn.k_norm.weight", "id"),
}


def json_out(cfg, base: dict) -> dict:
    return {**qwen2.json_out(cfg, base), "attention_bias": False}


FAMILY = Family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    defaults=DEFAULTS,
    switches={"qk_norm": True},
    windows="never",
    json_out=json_out,
    weights={"qk_norm": QK_NORM_NAMES},
)
