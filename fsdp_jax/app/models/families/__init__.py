"""Hugging Face model families: one module per family, each a `Family` record registered here.

    from fsdp_jax.app.models import families
    families.by_model_type("qwen3").switches          # {"qk_norm": True}

Registration order is the order import, export and error messages list them; a new
family is a new module here plus its line below (CONTRIBUTING.md, "Adding a model family").
"""

from fsdp_jax.app.models.families import (
    deepseek_v3,
    gemma3,
    gpt_oss,
    llama,
    mistral,
    mixtral,
    qwen2,
    qwen2_moe,
    qwen3,
    qwen3_moe,
)
from fsdp_jax.app.models.families.registry import (
    GENERIC_EXPERTS,
    Family,
    block_parts,
    by_architecture,
    by_model_type,
    expert_names,
    families,
    model_types,
    moe_weight_names,
    of_config,
    part_tensors,
    peft_modules,
    peft_parameters,
    peft_targets,
    register,
    unregister,
    weight_names,
)

for _module in (llama, mistral, qwen2, qwen3, gemma3, mixtral, qwen3_moe, qwen2_moe, gpt_oss, deepseek_v3):
    register(_module.FAMILY)

__all__ = [
    "GENERIC_EXPERTS",
    "Family",
    "block_parts",
    "by_architecture",
    "by_model_type",
    "expert_names",
    "families",
    "model_types",
    "moe_weight_names",
    "of_config",
    "part_tensors",
    "peft_modules",
    "peft_parameters",
    "peft_targets",
    "register",
    "unregister",
    "weight_names",
]
