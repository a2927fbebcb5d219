"""Reference models. They name logical dims only; sharding is applied from outside.

decoder, config, parts, attention, rope: the decoder; choices: its named choices (data, no JAX); lora: LoRA adapters on its projections;
families: one module per Hugging Face family (the registry import and export iterate).
"""

from typing import TYPE_CHECKING

from fsdp_jax.lazy_face import lazy_face

if TYPE_CHECKING:  # what static tools see; at run time each name loads on first use
    from fsdp_jax.app.models.config import DecoderConfig
    from fsdp_jax.app.models.decoder import Decoder, count_params, cross_entropy, flops_per_token

# module -> the names of the face it defines (loaded on first use: `fsdp_jax.lazy_face`), so the
# run config's schema reads `config` and `choices` without JAX
_FACE: dict[str, tuple[str, ...]] = {
    "fsdp_jax.app.models.config": ("DecoderConfig",),
    "fsdp_jax.app.models.decoder": ("Decoder", "count_params", "cross_entropy", "flops_per_token"),
}
__getattr__, __dir__ = lazy_face(__name__, _FACE)

__all__ = ["Decoder", "DecoderConfig", "count_params", "cross_entropy", "flops_per_token"]
