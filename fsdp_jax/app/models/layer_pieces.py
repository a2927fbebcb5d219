"""The reference decoder cut at its layer boundaries, for the layer-wise step of
`optimizer+params:nvme` (`fsdp_jax.nvme.layerwise.Pieces`).

    pieces = decoder_pieces(model_fns, cfg)   # model_fns: from_nnx(lambda r: Decoder(cfg, rngs=r))
    params = split_params(pure_params)        # {"layers": the stacked blocks, "rest": the rest}

The pieces compute what `cross_entropy(model.apply(params, tokens[:, :-1]), tokens[:, 1:])`
computes, one program each: the embedding (`Decoder.embed_tokens`), one `Block` (through
`layer_gather.gather_module`, as the scanned layer runs inside a train step) and the head with
the loss. Dense decoders with scanned layers only: no MoE, MTP, sliding-window pattern, LoRA,
packed rows or dropout (`pieces_problem` names the first such field).
"""

from __future__ import annotations

import jax
from flax import nnx

from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import Block, cross_entropy
from fsdp_jax.nvme.layerwise import Pieces
from fsdp_jax.train import layer_gather


def pieces_problem(cfg: DecoderConfig) -> str | None:
    """The first config field the layer-wise pieces do not cover, or None."""
    for field, bad in (
        ("scan_layers", not cfg.scan_layers),
        ("n_experts", bool(cfg.n_experts)),
        ("mtp_depth", bool(cfg.mtp_depth)),
        ("global_every", bool(cfg.sliding_window and cfg.global_every)),
    ):
        if bad:
            return f"model.{field}"
    return None


def split_params(params: dict) -> dict:
    """`{"layers": params["blocks"], "rest": the other entries}` (a pure dict of the decoder)."""
    return {"layers": params["blocks"], "rest": {k: v for k, v in params.items() if k != "blocks"}}


def decoder_pieces(model_fns, cfg: DecoderConfig, remat: str = "none") -> Pieces:
    """`Pieces` of the decoder `model_fns` binds (an NNX `ModelFns` of `Decoder(cfg, remat=remat)`);
    a batch is tokens (B, S + 1), as the train step's loss takes it. `remat`: the layer's policy
    inside its own vjp, as the scanned decoder applies it per block (`layer_gather.block_policy`)."""
    block_def, block_params, block_rest = nnx.split(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0))), nnx.Param, ...)
    blocks_abstract = model_fns.abstract_params["blocks"]

    def bind_rest(rest):
        return model_fns.bind({**rest, "blocks": blocks_abstract})

    def embed(rest, tokens):  # (B, S + 1) -> (B, S, D)
        return bind_rest(rest).embed_tokens(tokens[:, :-1])

    def block(p, h):  # one layer's pure params, (B, S, D) -> (B, S, D)
        st = jax.tree.map(lambda x: x, block_params)
        nnx.replace_by_pure_dict(st, p)
        return layer_gather.gather_module(nnx.merge(block_def, st, block_rest))(h)

    def layer(p, h):  # the policy read when traced: it depends on the step's layer-gather context
        policy = layer_gather.block_policy(remat)
        return (block if policy is None else jax.checkpoint(block, policy=policy))(p, h)

    def head(rest, h, tokens):  # -> the mean cross-entropy over tokens[:, 1:]
        return cross_entropy(bind_rest(rest)._head(h), tokens[:, 1:])

    return Pieces(embed, layer, head)
