"""gpt-oss (OpenAI, 2025): attention with a learned sink per head and q/k/v/o biases, sliding
and full layers alternating (`layer_types`), every layer a mixture of experts with a biased
router and biased experts whose SwiGLU is clamped (`swiglu_limit`, `swiglu_alpha`), YaRN RoPE
on every layer. Its block parts are its own (`models/sinks.py`, `models/moe_clamped.py`).

Tensors under model.layers.N (transformers' GptOssForCausalLM, as published): the Llama
q/k/v/o projections with q/k/v biases (Qwen2's names) and
  self_attn.o_proj.bias (D,), self_attn.sinks (H,)
  mlp.router.weight (E, D), mlp.router.bias (E,)
  mlp.experts.gate_up_proj (E, D, 2F) (in, out; gate / up interleaved), gate_up_proj_bias (E, 2F)
  mlp.experts.down_proj (E, F, D), down_proj_bias (E, D)
Published checkpoints store the two expert weights in MXFP4 (`<name>_blocks`, `<name>_scales`,
`quantization_config.quant_method: mxfp4`): import dequantises them (`fsdp_jax.app.hf.mxfp4`),
export writes them unquantised.
"""

from fsdp_jax.app.models.families.keys import int_key
from fsdp_jax.app.models.families.qwen2 import BIAS_NAMES
from fsdp_jax.app.models.families.registry import Family
from fsdp_jax.app.models.moe_clamped import ClampedMoE
from fsdp_jax.app.models.parts import BlockParts
from fsdp_jax.app.models.sinks import SinkAttention

# transformers' GptOssConfig defaults (5.25), for keys a config.json leaves out
DEFAULTS = {
    "rms_norm_eps": 1e-5,
    "rope_theta": 150000.0,
    "sliding_window": 128,
    "sliding_window_pattern": 2,  # no layer_types: transformers alternates, sliding first
    "attention_bias": True,
    "swiglu_limit": 7.0,
    "swiglu_alpha": 1.702,
    "router_aux_loss_coef": 0.001,
    "head_dim": 64,
    "rope_parameters": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
}


def _number(raw, key: str, bad, positive: bool = True) -> float:
    v = raw.get(key, DEFAULTS[key])
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not (v > 0 if positive else v >= 0):
        raise bad(key, "expected a positive number")
    return float(v)


def fields_in(raw, bad, get) -> dict:
    """Its own keys: the clamped SwiGLU, biases on every attention projection, and windows
    that name a layer that slides."""
    if raw.get("attention_bias", True) is not True:
        raise bad("attention_bias", "gpt-oss's attention has q/k/v/o biases (allowed: true)")
    types, window = raw.get("layer_types"), raw.get("sliding_window")
    if window is not None and isinstance(types, list) and "sliding_attention" not in types:
        raise bad("sliding_window", "set, but no layer_types entry is sliding_attention (allowed: null)")
    return {
        "swiglu_limit": _number(raw, "swiglu_limit", bad),
        "swiglu_alpha": _number(raw, "swiglu_alpha", bad),
        "attn_softcap": 0.0,
        "final_softcap": 0.0,
    }


def moe(raw, bad, n_layers: int) -> dict:
    """Every layer sparse, expert width `intermediate_size`, weights softmax over the top-k logits."""
    return {"moe_ffn_dim": int_key(raw, "intermediate_size", bad), "norm_topk_prob": True}


def moe_json(cfg) -> dict:
    return {"num_local_experts": cfg.n_experts, "intermediate_size": cfg.moe_ffn_dim}


def json_out(cfg, base: dict) -> dict:
    n = cfg.n_layers
    types = ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(n)]
    return {
        "attention_bias": True,
        "layer_types": types,
        "sliding_window": cfg.sliding_window or None,
        "swiglu_limit": cfg.swiglu_limit,
        "swiglu_alpha": cfg.swiglu_alpha,
    }


def part_weights(cfg) -> dict:
    """{our path under a block: (HF name under model.layers.N, kind, HF shape)} of its parts'
    params; `moe/...` replace the generic experts (kind `mx`: MXFP4-quantisable)."""
    d, e, f, h = cfg.d_model, cfg.n_experts, cfg.moe_ffn_dim, cfg.n_heads
    return {
        "attn/sinks": ("self_attn.sinks", "id", (h,)),
        "attn/bo": ("self_attn.o_proj.bias", "id", (d,)),
        "moe/router": ("mlp.router.weight", "t", (e, d)),
        "moe/router_bias": ("mlp.router.bias", "id", (e,)),
        "moe/w_gate_up": ("mlp.experts.gate_up_proj", "mx", (e, d, 2 * f)),
        "moe/b_gate_up": ("mlp.experts.gate_up_proj_bias", "id", (e, 2 * f)),
        "moe/w_down": ("mlp.experts.down_proj", "mx", (e, f, d)),
        "moe/b_down": ("mlp.experts.down_proj_bias", "id", (e, d)),
    }


FAMILY = Family(
    "gpt_oss",
    ("GptOssForCausalLM",),
    defaults=DEFAULTS,
    switches={"qkv_bias": True, "qk_norm": False, "shared_expert_ffn_dim": 0},
    windows="pattern",
    fields_in=fields_in,
    json_out=json_out,
    weights={"qkv_bias": BIAS_NAMES},
    moe=moe,
    moe_json=moe_json,
    parts=BlockParts(attention=SinkAttention, moe=ClampedMoE),
    part_weights=part_weights,
)
