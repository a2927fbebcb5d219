"""Hugging Face model families: one module per family, each a `Family` record registered here.

    from fsdp_jax.app.models import families
    families.by_model_type("qwen3").switches          # {"qk_norm": True}

Registration order is the order import, export and error messages list them; a new
family is a new module here plus its name in `registry.BUILT_IN` (CONTRIBUTING.md, "Adding a
model family"); the modules load on the registry's first use.
"""

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
