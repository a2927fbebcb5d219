"""Mistral: Llama's layers with a sliding window on every layer (or none)."""

from fsdp_jax.app.models.families.llama import DEFAULTS
from fsdp_jax.app.models.families.registry import Family


def json_out(cfg, base: dict) -> dict:
    return {"sliding_window": cfg.sliding_window or None}


FAMILY = Family(
    "mistral", ("MistralForCausalLM", "LlamaForCausalLM"), defaults=DEFAULTS, windows="all", json_out=json_out
)
