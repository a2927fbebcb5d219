"""Mixtral: Llama's attention (a window on every layer, or none) and every layer's MLP a
mixture of experts, top-k weights always renormalised, expert width `intermediate_size`.

Its experts' names are its own: `block_sparse_moe.gate` (the router) and
`block_sparse_moe.experts.<e>.w1 / w3 / w2` for gate / up / down.
"""

from fsdp_jax.app.models.families.keys import int_key
from fsdp_jax.app.models.families.registry import Family


def moe(raw, bad, n_layers: int) -> dict:
    return {"moe_ffn_dim": int_key(raw, "intermediate_size", bad), "norm_topk_prob": True}


def moe_json(cfg) -> dict:
    return {"num_local_experts": cfg.n_experts, "intermediate_size": cfg.moe_ffn_dim, "router_jitter_noise": 0.0}


def json_out(cfg, base: dict) -> dict:
    return {"sliding_window": cfg.sliding_window or None}


FAMILY = Family(
    "mixtral",
    ("MixtralForCausalLM",),
    defaults={"rms_norm_eps": 1e-5, "rope_theta": 1e6},
    # what a mixtral config.json gives and no Qwen one: no q/k norms, no biases, no shared expert
    switches={"qkv_bias": False, "qk_norm": False, "shared_expert_ffn_dim": 0},
    windows="all",
    json_out=json_out,
    moe=moe,
    moe_json=moe_json,
    moe_names=("block_sparse_moe", ("w1", "w3", "w2")),
)
