"""Qwen2 / Qwen2.5: Llama's layers with q/k/v projection biases, reshaped to (N, Dh).

Qwen's per-layer windows (`use_sliding_window`, `max_window_layers`) are refused.
"""

from fsdp_jax.app.models.families.llama import DEFAULTS
from fsdp_jax.app.models.families.registry import Family

BIAS_NAMES = {
    "attn/bq": ("self_attn.q_proj.bias", "bias"),
    "attn/bk": ("self_attn.k_proj.bias", "bias"),
    "attn/bv": ("self_attn.v_proj.bias", "bias"),
}


def json_out(cfg, base: dict) -> dict:
    """What every Qwen config.json writes about windows (none: full attention)."""
    n = cfg.n_layers
    return {
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": n,
        "layer_types": ["full_attention"] * n,
    }


FAMILY = Family(
    "qwen2",
    ("Qwen2ForCausalLM",),
    defaults=DEFAULTS,
    switches={"qkv_bias": True},
    windows="never",
    json_out=json_out,
    weights={"qkv_bias": BIAS_NAMES},
)
