"""DeepSeek-V3 (and R1, Kimi-K2: the same architecture): multi-head latent attention with q and
kv low-rank compression and a decoupled RoPE key (`models/latent_attention.py`), the first
`first_k_dense_replace` layers dense, the others a mixture of experts with grouped sigmoid
routing, a score-correction bias and shared experts (`models/moe_grouped.py`), YaRN with its
mscale. Multi-token prediction layers (`num_nextn_predict_layers`) are layers num_hidden_layers +
k - 1 (`fsdp_jax.app.hf.mtp_layout`); FP8 checkpoints (`quantization_config` fp8, 128 x 128
blocks as published) are dequantised on import (`fsdp_jax.app.hf.fp8_blocks`). LoRA by PEFT's
names on latent attention's projections, the dense layers' MLPs and the shared experts.

Tensors under model.layers.N (transformers' DeepseekV3ForCausalLM as it saves them):
  self_attn.q_a_proj.weight (r_q, D), q_a_layernorm.weight, q_b_proj.weight (H (Dn + Dr), r_q)
  (or q_proj.weight when q_lora_rank is null), kv_a_proj_with_mqa.weight (r_kv + Dr, D),
  kv_a_layernorm.weight, kv_b_proj.weight (H (Dn + Dv), r_kv), o_proj.weight (D, H Dv);
  dense layers mlp.{gate,up,down}_proj.weight; sparse layers mlp.gate.weight (E, D),
  mlp.gate.e_score_correction_bias (E,), mlp.experts.<e>.{gate,up,down}_proj.weight,
  mlp.shared_experts.{gate,up,down}_proj.weight.
"""

from fsdp_jax.app.models.families.keys import int_key
from fsdp_jax.app.models.families.registry import Family
from fsdp_jax.app.models.latent_attention import LatentAttention
from fsdp_jax.app.models.moe_grouped import GroupedMoE
from fsdp_jax.app.models.parts import BlockParts

# transformers' DeepseekV3Config defaults (5.25) for keys a config.json leaves out
DEFAULTS = {
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "router_aux_loss_coef": 0.0,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.5,
    "n_group": 8,
    "topk_group": 4,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128,
    "v_head_dim": 128,
}


def fields_in(raw, bad, get) -> dict:
    """Latent attention's widths; RoPE on interleaved pairs; no attention bias. (MTP layers:
    `model.mtp_depth`, a run's choice, read in `fsdp_jax.app.hf.mtp_layout`.)"""
    q = get("q_lora_rank")
    out = {"q_lora_rank": 0 if q is None else int_key({"q_lora_rank": q}, "q_lora_rank", bad)}
    for key in ("kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
        out[key] = int_key({key: get(key)}, key, bad)
    rope = int_key({"qk_rope_head_dim": get("qk_rope_head_dim")}, "qk_rope_head_dim", bad)
    if rope % 2:
        raise bad("qk_rope_head_dim", "expected an even integer")
    if raw.get("head_dim") not in (None, rope):
        raise bad("head_dim", f"disagrees with qk_rope_head_dim={rope} (transformers sets one from the other)")
    out["kv_channels"] = rope
    if raw.get("rope_interleave", True) is not True:
        raise bad("rope_interleave", "the RoPE dims are read as DeepSeek lays them out, in pairs (allowed: true)")
    if raw.get("attention_bias", False):
        raise bad("attention_bias", "DeepSeek-V3's projections have no biases (allowed: false)")
    int_key({"num_nextn_predict_layers": raw.get("num_nextn_predict_layers") or 0}, "num_nextn_predict_layers", bad, 0)
    return {**out, "attn_softcap": 0.0, "final_softcap": 0.0}


def moe(raw, bad, n_layers: int) -> dict:
    """Expert width, groups, scaling, shared experts, the dense first layers."""
    get = lambda k: raw.get(k, DEFAULTS.get(k))  # noqa: E731
    f = int_key(raw, "moe_intermediate_size", bad)
    groups, top = (int_key({k: get(k)}, k, bad) for k in ("n_group", "topk_group"))
    experts = raw.get("n_routed_experts", raw.get("num_local_experts"))
    if isinstance(experts, int) and experts % groups:
        raise bad("n_group", f"must divide n_routed_experts={experts}")
    if isinstance(experts, int) and experts // groups < 2:
        raise bad("n_group", "a group scores its best two experts: at least 2 experts per group")
    if top > groups:
        raise bad("topk_group", f"larger than n_group={groups}")
    dense = int_key({"first_k_dense_replace": get("first_k_dense_replace")}, "first_k_dense_replace", bad, low=0)
    if dense >= n_layers:
        raise bad("first_k_dense_replace", f"leaves no sparse layer of {n_layers}")
    if raw.get("scoring_func", "sigmoid") != "sigmoid" or raw.get("topk_method", "noaux_tc") != "noaux_tc":
        raise bad("scoring_func", "DeepSeek-V3 routes by sigmoid scores, noaux_tc (allowed: sigmoid)")
    scale, norm = get("routed_scaling_factor"), get("norm_topk_prob")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or scale <= 0:
        raise bad("routed_scaling_factor", "expected a positive number")
    if not isinstance(norm, bool):
        raise bad("norm_topk_prob", "expected true or false")
    shared = int_key({"n_shared_experts": get("n_shared_experts")}, "n_shared_experts", bad)
    return {
        "moe_ffn_dim": f,
        "norm_topk_prob": norm,
        "n_group": groups,
        "topk_group": top,
        "routed_scaling_factor": float(scale),
        "shared_experts_ffn_dim": shared * f,
        "mlp_only_layers": tuple(range(dense)),
    }


def moe_json(cfg) -> dict:
    return {
        "n_routed_experts": cfg.n_experts,
        "moe_intermediate_size": cfg.moe_ffn_dim,
        "n_shared_experts": cfg.shared_experts_ffn_dim // max(cfg.moe_ffn_dim, 1),  # export tries every family
        "n_group": cfg.n_group,
        "topk_group": cfg.topk_group,
        "routed_scaling_factor": cfg.routed_scaling_factor,
        "norm_topk_prob": cfg.norm_topk_prob,
        "first_k_dense_replace": len(cfg.mlp_only_layers),
    }


def json_out(cfg, base: dict) -> dict:
    return {
        "attention_bias": False,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.head_dim,
        "qk_head_dim": cfg.qk_nope_head_dim + cfg.head_dim,
        "v_head_dim": cfg.v_head_dim,
        "pretraining_tp": 1,
        "rope_interleave": True,
        "num_nextn_predict_layers": cfg.mtp_depth,
    }


def part_weights(cfg) -> dict:
    """{our path under a block: (HF name under model.layers.N, kind, HF shape)} of its parts."""
    d, h, dr, dn, dv = cfg.d_model, cfg.n_heads, cfg.head_dim, cfg.qk_nope_head_dim, cfg.v_head_dim
    rq, rkv, e, fs = cfg.q_lora_rank, cfg.kv_lora_rank, cfg.n_experts, cfg.shared_experts_ffn_dim
    if rq:
        q = {
            "attn/wq_a": ("self_attn.q_a_proj.weight", "t", (rq, d)),
            "attn/q_a_norm/scale": ("self_attn.q_a_layernorm.weight", "id", (rq,)),
            "attn/wq_b": ("self_attn.q_b_proj.weight", "qkv", (h * (dn + dr), rq)),
        }
    else:
        q = {"attn/wq": ("self_attn.q_proj.weight", "qkv", (h * (dn + dr), d))}
    return {
        **q,
        "attn/wkv_a": ("self_attn.kv_a_proj_with_mqa.weight", "t", (rkv + dr, d)),
        "attn/kv_a_norm/scale": ("self_attn.kv_a_layernorm.weight", "id", (rkv,)),
        "attn/wkv_b": ("self_attn.kv_b_proj.weight", "qkv", (h * (dn + dv), rkv)),
        "attn/wo": ("self_attn.o_proj.weight", "o", (d, h * dv)),
        "moe/score_bias": ("mlp.gate.e_score_correction_bias", "id", (e,)),
        "moe/shared_gate": ("mlp.shared_experts.gate_proj.weight", "t", (fs, d)),
        "moe/shared_up": ("mlp.shared_experts.up_proj.weight", "t", (fs, d)),
        "moe/shared_down": ("mlp.shared_experts.down_proj.weight", "t", (d, fs)),
    }


# PEFT's modules under model.layers.N: latent attention's nn.Linear projections (target_modules)
PEFT_NAMES = {
    "attn/wq": "self_attn.q_proj",
    "attn/wq_a": "self_attn.q_a_proj",
    "attn/wq_b": "self_attn.q_b_proj",
    "attn/wkv_a": "self_attn.kv_a_proj_with_mqa",
    "attn/wkv_b": "self_attn.kv_b_proj",
    "attn/wo": "self_attn.o_proj",
    "router/router": "mlp.gate",  # the router (E, D): peft 0.21's all-linear adapts it as target_parameters
}
MLP = ("w_gate", "w_up", "w_down")
# the shared experts' (sparse layers); the dense layers' MLPs are the generic mlp.{gate,up,down}_proj
SHARED_PEFT_NAMES = {
    f"shared/{w}": f"mlp.shared_experts.{n}" for w, n in zip(MLP, ("gate_proj", "up_proj", "down_proj"))
}
# peft 0.21 on transformers 5.25 rewrites target_modules gate_proj / up_proj / down_proj (and all-linear's)
# to the fused routed experts (DeepseekV3 takes Qwen2-MoE's v4 -> v5 conversion), so the dense MLPs and
# shared experts are reached only as target_parameters `mlp.gate_proj.weight`,
# `mlp.shared_experts.gate_proj.weight`, ... (a ParamWrapper per nn.Linear weight: the same tensor names)
PEFT_PARAMETERS = tuple(f"{site}/{w}" for site in ("mlp", "shared") for w in MLP) + ("router/router",)

FAMILY = Family(
    "deepseek_v3",
    ("DeepseekV3ForCausalLM",),
    defaults=DEFAULTS,
    switches={"qkv_bias": False, "qk_norm": False, "shared_expert_ffn_dim": 0},
    windows="none",
    fields_in=fields_in,
    json_out=json_out,
    moe=moe,
    moe_json=moe_json,
    parts=BlockParts(attention=LatentAttention, moe=GroupedMoE),
    part_weights=part_weights,
    peft_names={"kv_lora_rank": PEFT_NAMES, "shared_experts_ffn_dim": SHARED_PEFT_NAMES},
    peft_parameters=PEFT_PARAMETERS,
    mtp_key="num_nextn_predict_layers",
)
