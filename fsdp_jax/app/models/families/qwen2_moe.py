"""Qwen2-MoE: Qwen2's attention (q/k/v biases), Qwen3-MoE's experts, and a sigmoid-gated
shared expert of width `shared_expert_intermediate_size` on every sparse layer:
  moe/shared_{gate,up,down}   <- mlp.shared_expert.{gate,up,down}_proj.weight
  moe/shared_weight (D, 1)    <- mlp.shared_expert_gate.weight (1, D)
PEFT adapts the shared expert's projections as `mlp.shared_expert.{gate,up,down}_proj` and
its gate as `mlp.shared_expert_gate` (a `target_modules` name of its own).
"""

from fsdp_jax.app.models.families import qwen2, qwen3_moe
from fsdp_jax.app.models.families.keys import int_key
from fsdp_jax.app.models.families.llama import DEFAULTS
from fsdp_jax.app.models.families.registry import Family

SHARED_NAMES = {
    "moe/shared_gate": ("mlp.shared_expert.gate_proj.weight", "t"),
    "moe/shared_up": ("mlp.shared_expert.up_proj.weight", "t"),
    "moe/shared_down": ("mlp.shared_expert.down_proj.weight", "t"),
    "moe/shared_weight": ("mlp.shared_expert_gate.weight", "t"),
}

PEFT_NAMES = {
    "shared/w_gate": "mlp.shared_expert.gate_proj",
    "shared/w_up": "mlp.shared_expert.up_proj",
    "shared/w_down": "mlp.shared_expert.down_proj",
    "shared/w_shared_gate": "mlp.shared_expert_gate",
}


def moe(raw, bad, n_layers: int) -> dict:
    out = qwen3_moe.moe(raw, bad, n_layers)
    if raw.get("qkv_bias", True) is not True:
        raise bad("qkv_bias", "Qwen2-MoE's attention has q/k/v biases (allowed: true)")
    out["shared_expert_ffn_dim"] = int_key(raw, "shared_expert_intermediate_size", bad, low=0)
    return out


def moe_json(cfg) -> dict:
    return {**qwen3_moe.moe_json(cfg), "shared_expert_intermediate_size": cfg.shared_expert_ffn_dim, "qkv_bias": True}


FAMILY = Family(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    defaults=DEFAULTS,
    switches={"qkv_bias": True},
    windows="never",
    json_out=qwen2.json_out,
    weights={"qkv_bias": qwen2.BIAS_NAMES},
    moe=moe,
    moe_json=moe_json,
    moe_weights={"shared_expert_ffn_dim": SHARED_NAMES},
    peft_names={"shared_expert_ffn_dim": PEFT_NAMES},
)
