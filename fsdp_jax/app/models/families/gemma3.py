"""Gemma 3 (text): (1 + w) norms, post-attention / post-MLP norms, sqrt(hidden) embedding
scale, q/k norms, every N-th layer full and the others sliding with their own RoPE base,
query_pre_attn_scalar and a final logit soft-cap.

Gemma 3's `post_attention_layernorm` is our `post_attn_norm` and its
`pre_feedforward_layernorm` our `mlp_norm` (in the other families
`post_attention_layernorm` is the pre-MLP norm).
"""

from fsdp_jax.app.models.families.qwen3 import QK_NORM_NAMES
from fsdp_jax.app.models.families.registry import Family

SANDWICH_NAMES = {
    "post_attn_norm/scale": ("post_attention_layernorm.weight", "id"),
    "mlp_norm/scale": ("pre_feedforward_layernorm.weight", "id"),
    "post_mlp_norm/scale": ("post_feedforward_layernorm.weight", "id"),
}
# transformers' Gemma3TextConfig defaults
DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 1e6,
    "rope_local_base_freq": 1e4,
    "hidden_activation": "gelu_pytorch_tanh",
    "query_pre_attn_scalar": 256,
    "sliding_window": 4096,
    "tie_word_embeddings": True,
    "head_dim": 256,
    "sliding_window_pattern": 6,
    "vocab_size": 262208,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "num_hidden_layers": 26,
    "num_attention_heads": 8,
    "num_key_value_heads": 4,
    "max_position_embeddings": 131072,
}
SOFTCAP_KEYS = (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap"))


def fields_in(raw, bad, get) -> dict:
    """Its own keys: logit soft-capping, query_pre_attn_scalar, and causal attention."""
    out = {}
    for key, field in SOFTCAP_KEYS:
        v = raw.get(key)
        if v is not None and key == "attn_logit_softcapping":  # 5.24 never passes it on
            raise bad(key, "transformers' Gemma 3 does not apply it, so its logits would differ (allowed: null)")
        if v is not None and not (isinstance(v, (int, float)) and v > 0):
            raise bad(key, "expected a positive number or null")
        out[field] = float(v or 0.0)
    q = get("query_pre_attn_scalar")
    if not (isinstance(q, (int, float)) and not isinstance(q, bool) and q > 0):
        raise bad("query_pre_attn_scalar", "expected a positive number")
    out["query_pre_attn_scalar"] = float(q)
    if raw.get("use_bidirectional_attention"):
        raise bad("use_bidirectional_attention", "the decoder is causal (allowed: false)")
    return out


def _int_if_whole(v: float) -> int | float:
    return int(v) if float(v).is_integer() else v  # transformers 5 types it int (strict)


def json_out(cfg, base: dict) -> dict:
    n = cfg.n_layers
    every = cfg.global_every if cfg.sliding_window else 1  # 1: every layer full
    types = ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(n)]
    local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or 1e4}
    return {
        "attention_bias": False,
        "layer_types": types,
        "sliding_window": cfg.sliding_window or cfg.max_seq_len,
        "sliding_window_pattern": every or n + 1,
        "rope_parameters": {"full_attention": base["rope_parameters"], "sliding_attention": local},
        "rope_local_base_freq": local["rope_theta"],
        "query_pre_attn_scalar": _int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
        "attn_logit_softcapping": None,
        "final_logit_softcapping": cfg.final_softcap or None,
        "use_bidirectional_attention": False,
    }


FAMILY = Family(
    "gemma3_text",
    ("Gemma3ForCausalLM",),
    activation_key="hidden_activation",
    defaults=DEFAULTS,
    switches={"qk_norm": True, "norm_plus_one": True, "sandwich_norm": True, "embed_scale": True},
    windows="pattern",
    fields_in=fields_in,
    json_out=json_out,
    weights={"qk_norm": QK_NORM_NAMES, "sandwich_norm": SANDWICH_NAMES},
)
