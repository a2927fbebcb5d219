"""The mixture-of-experts keys of a Hugging Face config.json, in and out.

Common to every MoE family: the experts count (`num_local_experts` or `num_experts`), top-k,
the load-balancing loss weight; each family's own keys (expert width, which layers are
sparse, a shared expert) are its record's `Family.moe` / `Family.moe_json`
(`fsdp_jax.app.models.families`). Routers the decoder does not compute are refused by
name: model types with other routers (`OTHER_ROUTERS`) and router keys of such routers
in any config.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fsdp_jax.app.models import families
from fsdp_jax.app.models.families.keys import int_key

# model_type -> what its router does that the decoder's softmax top-k router does not
OTHER_ROUTERS = {
    "deepseek_v2": "DeepSeek-V2's grouped routing (n_group / topk_group, routed_scaling_factor)",
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


def refuse_other_router(mt: str, bad) -> None:
    """bad("model_type", ...) naming the router of `mt` when it is one the decoder does not compute."""
    if mt in OTHER_ROUTERS:
        moe_types = ", ".join(f.model_type for f in families.families() if f.is_moe)
        raise bad("model_type", f"{OTHER_ROUTERS[mt]} is not computed by the decoder (allowed: {moe_types})")


def moe_fields(raw: Mapping, fam: families.Family, bad, n_layers: int) -> dict:
    """DecoderConfig MoE fields of a config.json of family `fam` ({} for dense families)."""
    refuse_other_router(fam.model_type, bad)
    if not fam.is_moe:
        return {}
    for key, allowed in OTHER_ROUTER_KEYS.items() if not fam.parts.moe else ():  # a router part reads its own
        if raw.get(key) not in (None, allowed):
            raise bad(key, f"another router's key: the decoder routes by softmax then top-k (allowed: {allowed})")
    if raw.get("router_jitter_noise"):
        raise bad("router_jitter_noise", "the router adds no noise (allowed: 0)")
    ekey = next((k for k in ("num_local_experts", "n_routed_experts") if raw.get(k) is not None), "num_experts")
    e = int_key(raw, ekey, bad)
    k = int_key(raw, "num_experts_per_tok", bad)
    if k > e:
        raise bad("num_experts_per_tok", f"top-k larger than {ekey}={e}")
    out: dict[str, Any] = {"n_experts": e, "experts_per_token": k}
    coef = raw.get("router_aux_loss_coef", 0.001)
    if isinstance(coef, bool) or not isinstance(coef, (int, float)) or coef < 0:
        raise bad("router_aux_loss_coef", "expected a number >= 0")
    out["router_aux_loss_coef"] = float(coef)
    out.update(fam.moe(raw, bad, n_layers))
    return out


def moe_json(cfg, fam: families.Family) -> dict:
    """The MoE keys of config.json for `cfg` in family `fam`."""
    d: dict[str, Any] = {
        "num_experts_per_tok": cfg.experts_per_token,
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "output_router_logits": False,
    }
    return {**d, **fam.moe_json(cfg)}
