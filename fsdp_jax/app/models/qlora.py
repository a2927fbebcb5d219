"""QLoRA on the reference decoder: which of its weights a quantised base quantises and how
(`LoraSpec.base_quant`, the run config's `lora.base_quant`), and the line refusing a model
it cannot quantise. The quantisation itself is the library's (`fsdp_jax.quant`)."""

from __future__ import annotations

from fsdp_jax.app.models.lora import LoraSpec, adapted, weight_dims

# how many leading dims of each weight its product contracts (int8's per-output-channel absmax)
CONTRACTED = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


def quant_problem(cfg, spec: LoraSpec) -> str | None:
    """None, or the line refusing `spec.base_quant` on model `cfg`: routed experts (not
    quantised yet), a target whose last dim a block does not divide or is smaller than one."""
    if spec.base_quant is None:
        return None
    if cfg.n_experts:
        return "a quantised base is for dense models (routed experts are not quantised yet)"
    for name in adapted(cfg, spec)[0]:
        _, _, out_shape, _ = weight_dims(cfg, name)
        shape = weight_dims(cfg, name)[0] + out_shape
        problem = spec.base_quant.problem(name, shape)
        if problem:
            return problem
    return None
