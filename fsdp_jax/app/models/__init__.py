"""Reference models. They name logical dims only; sharding is applied from outside.

llama, attention, rope: the decoder; lora: LoRA adapters on its projections.
"""

from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import Decoder, count_params, cross_entropy, flops_per_token

__all__ = ["Decoder", "DecoderConfig", "count_params", "cross_entropy", "flops_per_token"]
