"""The parts a decoder block is built from, as one record a model family may replace.

    Decoder(cfg, rngs=nnx.Rngs(0), parts=BlockParts(attention=LatentAttention))

Each part is a factory `part(cfg, rngs) -> nnx.Module` with the default module's call
signature (`attention(x, local, segment_ids, positions, dropout_key)`, `mlp(x, dropout_key)`,
`moe(x, token_mask, dropout_key) -> (y, RouterStats)`); None keeps the decoder's own
(`fsdp_jax.app.models.self_attention.Attention`, `decoder.FeedForward`, `moe.MoE`). A
family names its parts in its record (`fsdp_jax.app.models.families.Family.parts`), so a
new attention variant (latent attention, attention sinks) needs no fork of the decoder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable


@dataclasses.dataclass(frozen=True)
class BlockParts:
    """Factories of a block's attention, dense MLP and sparse MLP; None: the decoder's own."""

    attention: Callable | None = None
    mlp: Callable | None = None
    moe: Callable | None = None


DEFAULT_PARTS = BlockParts()
