"""Llama (2, 3, 3.1, 3.2): the reference family; its per-layer weight names are every family's base.

Layout (measured against transformers' LlamaForCausalLM, docs/design.md): per layer
`q/k/v_proj.weight.T` reshaped to (D, H, Dh), `o_proj.weight.T` to (H, Dh, D),
`gate/up/down_proj.weight.T`, norms as they are. A windowless Mistral is a Llama, so each
accepts the other's architecture.
"""

from fsdp_jax.app.models.families.registry import Family

LAYER_NAMES = {
    "attn/wq": ("self_attn.q_proj.weight", "qkv"),
    "attn/wk": ("self_attn.k_proj.weight", "qkv"),
    "attn/wv": ("self_attn.v_proj.weight", "qkv"),
    "attn/wo": ("self_attn.o_proj.weight", "o"),
    "mlp/w_gate": ("mlp.gate_proj.weight", "t"),
    "mlp/w_up": ("mlp.up_proj.weight", "t"),
    "mlp/w_down": ("mlp.down_proj.weight", "t"),
    "attn_norm/scale": ("input_layernorm.weight", "id"),
    "mlp_norm/scale": ("post_attention_layernorm.weight", "id"),
}
# PEFT's modules (target_modules: their last parts, q_proj ... down_proj) of the projections
PEFT_NAMES = {ours: name.removesuffix(".weight") for ours, (name, kind) in LAYER_NAMES.items() if kind != "id"}
DEFAULTS = {"rms_norm_eps": 1e-6, "rope_theta": 10000.0}


def json_out(cfg, base: dict) -> dict:
    return {"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1}


FAMILY = Family(
    "llama",
    ("LlamaForCausalLM", "MistralForCausalLM"),
    defaults=DEFAULTS,
    windows="none",
    json_out=json_out,
    weights={"": LAYER_NAMES},
    peft_names={"": PEFT_NAMES},
)
