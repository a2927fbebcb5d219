"""Which LoRA specs a model refuses, as (config key, one line): targets naming nothing on it,
experts' gate and up asked apart, expert tensors where there are none, dropout where PEFT has
none (its target_parameters), a gate_up rank without the experts' gate_up adapter. The decoder
raises them (`models/decoder.py`); the config checks report them before anything is built."""

from __future__ import annotations

from fsdp_jax.app.models.families import registry
from fsdp_jax.app.models.lora import (
    MLP_WEIGHTS,
    ROUTER,
    SHARED_GATE,
    TARGETS,
    LoraSpec,
    adapted,
    attention_weights,
    linear_mlps,
    own_experts,
    peft_targets,
)


def target_problem(cfg, spec: LoraSpec) -> tuple[str, str] | None:
    """None, or (config key, the one line refusing `spec` on model `cfg`): a target naming
    nothing on it (the line lists the names that do), the experts' gate and up projections asked
    apart (one fused tensor per expert), expert tensors on a model without experts or on a family's own."""
    if spec.experts is not None and spec.experts and not cfg.n_experts:
        return "lora.target_parameters", "the model has no routed experts (n_experts 0): use auto or none"
    if spec.experts and own_experts(cfg) is True:
        return "lora.target_parameters", f"{cfg.family}'s experts take no adapters: use auto or none"
    auto = cfg.n_experts and spec.experts is None and not own_experts(cfg)
    if auto and ("w_gate" in spec.targets) != ("w_up" in spec.targets):
        return "lora.targets", (
            "gate_proj and up_proj are one fused tensor per expert (transformers' experts.gate_up_proj, "
            "one PEFT adapter): target both or neither, or set lora.target_parameters"
        )
    mods, experts = adapted(cfg, spec)
    if spec.gate_up_rank and "experts_gate_up" not in experts:
        return "lora.gate_up_rank", "sets the routed experts' gate_up_proj rank, but no adapter there takes it"
    names = {v: k for k, v in peft_targets().items()}
    exist = list(attention_weights(cfg)) + [t for t in MLP_WEIGHTS if linear_mlps(cfg) or auto]
    exist += [SHARED_GATE] if cfg.shared_expert_ffn_dim else []
    exist += [ROUTER] if ROUTER in adapted(cfg, LoraSpec(1, 1.0, (ROUTER,)))[0] else []  # DeepSeek-V3's router
    absent = [t for t in spec.targets if t not in exist and spec.targets != TARGETS]  # all-linear: what there is
    if absent:
        shown = " ".join(names[t] for t in exist)
        return "lora.targets", f"{' '.join(names[t] for t in absent)} names nothing on this model; it has {shown}"
    return None


def expert_dropout(cfg, spec: LoraSpec) -> str | None:
    """None, or the line refusing dropout with adapters on experts or on weights PEFT reaches as
    target_parameters (PEFT's ParamWrapper has no dropout)."""
    mods, experts = adapted(cfg, spec)
    by_param = {p.split("/")[1] for p in registry.peft_parameters(cfg)} & set(mods)
    if spec.dropout and (cfg.n_experts and experts or by_param):
        what = f"{cfg.family}'s MLPs" if by_param else "experts"
        return f"adapters on {what} take no dropout (PEFT's target_parameters refuse lora_dropout): set lora.dropout=0"
    return None
