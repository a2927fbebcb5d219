"""Qwen3-MoE: Qwen3's attention (q/k norms) and a mixture of experts of width
`moe_intermediate_size` on the layers `decoder_sparse_step` and `mlp_only_layers` pick,
top-k weights renormalised when `norm_topk_prob`. transformers 5.24 writes the experts
count as `num_local_experts`, 4.x reads `num_experts`: both are written.
"""

from fsdp_jax.app.models.families import qwen3
from fsdp_jax.app.models.families.keys import int_key
from fsdp_jax.app.models.families.llama import DEFAULTS
from fsdp_jax.app.models.families.registry import Family


def moe(raw, bad, n_layers: int) -> dict:
    """The Qwen MoE keys: expert width, renormalisation, which layers are sparse."""
    out = {"moe_ffn_dim": int_key(raw, "moe_intermediate_size", bad)}
    norm = raw.get("norm_topk_prob", False)
    if not isinstance(norm, bool):
        raise bad("norm_topk_prob", "expected true or false")
    out["norm_topk_prob"] = norm
    out["decoder_sparse_step"] = int_key(raw, "decoder_sparse_step", bad) if "decoder_sparse_step" in raw else 1
    only = raw.get("mlp_only_layers") or []
    if not isinstance(only, list) or any(isinstance(i, bool) or not isinstance(i, int) for i in only):
        raise bad("mlp_only_layers", "expected a list of layer indices")
    if any(not 0 <= i < n_layers for i in only):
        raise bad("mlp_only_layers", f"layer indices are 0..{n_layers - 1}")
    out["mlp_only_layers"] = tuple(sorted(set(only)))
    return out


def moe_json(cfg) -> dict:
    return {
        "num_experts": cfg.n_experts,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
    }


FAMILY = Family(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    defaults=DEFAULTS,
    switches={"qk_norm": True},
    windows="never",
    json_out=qwen3.json_out,
    weights={"qk_norm": qwen3.QK_NORM_NAMES},
    moe=moe,
    moe_json=lambda cfg: {**moe_json(cfg), "num_local_experts": cfg.n_experts},  # 5.24 and 4.x
)
