"""Reference models. They name logical dims only; sharding is applied from outside.

decoder, config, parts, attention, rope: the decoder; lora: LoRA adapters on its projections;
families: one module per Hugging Face family (the registry import and export iterate).
"""

from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import Decoder, count_params, cross_entropy, flops_per_token

__all__ = ["Decoder", "DecoderConfig", "count_params", "cross_entropy", "flops_per_token"]
