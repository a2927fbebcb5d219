"""The mixture-of-experts keys of a Hugging Face config.json, in and out.

Families: mixtral (every layer sparse, top-k weights always renormalised, expert width
`intermediate_size`), qwen3_moe and qwen2_moe (`moe_intermediate_size`, `norm_topk_prob`,
`decoder_sparse_step`, `mlp_only_layers`; Qwen2-MoE's sigmoid-gated shared expert of
`shared_expert_intermediate_size`). The experts count is `num_local_experts` or
`num_experts` (transformers 5.24 writes the first for Qwen3-MoE, the second for
Qwen2-MoE). Routers the decoder does not compute are refused by name: model types with
other routers (`OTHER_ROUTERS`) and router keys of such routers in any config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

MOE_TYPES = ("mixtral", "qwen3_moe", "qwen2_moe")
# model_type -> what its router does that the decoder's softmax top-k router does not
OTHER_ROUTERS = {
    "deepseek_v2": "DeepSeek-V2's grouped routing (n_group / topk_group, routed_scaling_factor)",
    "deepseek_v3": "DeepSeek-V3's sigmoid routing with a score-correction bias and expert groups",
    "gpt_oss": "gpt-oss's router (top-k on logits, then softmax, with router biases) and its clamped SwiGLU experts",
    "llama4_text": "Llama 4's sigmoid router with a shared expert on every layer",
    "qwen3_next": "Qwen3-Next's hybrid linear-attention layers",
}
# router keys of other routers: refused when set (not null / default) in any MoE config
OTHER_ROUTER_KEYS = {
    "scoring_func": "softmax",
    "n_group": None,
    "topk_group": None,
    "topk_method": None,
    "routed_scaling_factor": None,
    "n_shared_experts": None,
    "first_k_dense_replace": None,
}


def _int(raw: Mapping, key: str, bad, low: int = 1) -> int:
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise bad(key, f"expected an integer >= {low}")
    return v


def refuse_other_router(mt: str, bad) -> None:
    """bad("model_type", ...) naming the router of `mt` when it is one the decoder does not compute."""
    if mt in OTHER_ROUTERS:
        raise bad("model_type", f"{OTHER_ROUTERS[mt]} is not computed by the decoder (allowed: {', '.join(MOE_TYPES)})")


def moe_fields(raw: Mapping, mt: str, bad, n_layers: int) -> dict:
    """DecoderConfig MoE fields of a config.json of model_type `mt` ({} for dense families)."""
    refuse_other_router(mt, bad)
    if mt not in MOE_TYPES:
        return {}
    for key, allowed in OTHER_ROUTER_KEYS.items():
        if raw.get(key) not in (None, allowed):
            raise bad(key, f"another router's key: the decoder routes by softmax then top-k (allowed: {allowed})")
    if raw.get("router_jitter_noise"):
        raise bad("router_jitter_noise", "the router adds no noise (allowed: 0)")
    ekey = "num_local_experts" if raw.get("num_local_experts") is not None else "num_experts"
    e = _int(raw, ekey, bad)
    k = _int(raw, "num_experts_per_tok", bad)
    if k > e:
        raise bad("num_experts_per_tok", f"top-k larger than {ekey}={e}")
    out: dict[str, Any] = {"n_experts": e, "experts_per_token": k}
    coef = raw.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise bad("router_aux_loss_coef", "expected a number >= 0")
    out["router_aux_loss_coef"] = float(coef)
    if mt == "mixtral":
        out.update(moe_ffn_dim=_int(raw, "intermediate_size", bad), norm_topk_prob=True)
        return out
    out["moe_ffn_dim"] = _int(raw, "moe_intermediate_size", bad)
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise bad("norm_topk_prob", "expected true or false")
    out["norm_topk_prob"] = norm
    out["decoder_sparse_step"] = _int(raw, "decoder_sparse_step", bad) if "decoder_sparse_step" in raw else 1
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise bad("mlp_only_layers", "expected a list of layer indices")
    if any(not 0 <= i < n_layers for i in only):
        raise bad("mlp_only_layers", f"layer indices are 0..{n_layers - 1}")
    out["mlp_only_layers"] = tuple(sorted(set(only)))
    if mt == "qwen2_moe":
        if raw.get("qkv_bias", True) is not True:
            raise bad("qkv_bias", "Qwen2-MoE's attention has q/k/v biases (allowed: true)")
        out["shared_expert_ffn_dim"] = _int(raw, "shared_expert_intermediate_size", bad, low=0)
    return out


def moe_json(cfg, mt: str) -> dict:
    """The MoE keys of config.json for `cfg` as model_type `mt`."""
    d: dict[str, Any] = {
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }
    if mt == "mixtral":
        d.update(num_local_experts=cfg.n_experts, intermediate_size=cfg.moe_ffn_dim, router_jitter_noise=0.0)
        return d
    d.update(
        num_experts=cfg.n_experts,
        moe_intermediate_size=cfg.moe_ffn_dim,
        norm_topk_prob=cfg.norm_topk_prob,
        decoder_sparse_step=cfg.decoder_sparse_step,
        mlp_only_layers=list(cfg.mlp_only_layers),
    )
    if mt == "qwen3_moe":  # 5.24 writes num_local_experts; 4.x reads num_experts
        d["num_local_experts"] = cfg.n_experts
    if mt == "qwen2_moe":
        d.update(shared_expert_intermediate_size=cfg.shared_expert_ffn_dim, qkv_bias=True)
    return d
