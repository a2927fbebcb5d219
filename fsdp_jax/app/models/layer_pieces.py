"""The reference decoder cut at its layer boundaries, for the layer-wise step of
`optimizer+params:nvme` (`fsdp_jax.nvme.layerwise.Pieces`).

    pieces = decoder_pieces(model_fns, cfg)   # model_fns: from_nnx(lambda r: Decoder(cfg, rngs=r))
    params = split_params(pure_params)        # {"layers": the stacked blocks, "rest": the rest}

The pieces compute what `cross_entropy(model.apply(params, tokens[:, :-1]), tokens[:, 1:])`
(or the trainer's loss of a packed batch) computes, one program each: the embedding (`Decoder.embed_tokens`), one `Block` (through
`layer_gather.gather_module`, as the scanned layer runs inside a train step) and the head with
the loss. Dense decoders with scanned layers only: no MoE, MTP, sliding-window pattern, LoRA or
dropout (`pieces_problem` names the first such field); packed and document-masked rows run
(`inputs` / `loss` of `decoder_pieces`).
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


def token_inputs(tokens) -> dict:
    """The decoder's inputs and the loss's targets of int32 tokens (B, S + 1): positions and
    segment ids None, no weights (every target trained)."""
    return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "segment_ids": None, "positions": None, "weights": None}


def mean_loss(logits, b: dict):
    """The mean cross-entropy over `b`'s targets."""
    return cross_entropy(logits, b["targets"])


def decoder_pieces(model_fns, cfg: DecoderConfig, remat: str = "none", inputs=token_inputs, loss=mean_loss) -> Pieces:
    """`Pieces` of the decoder `model_fns` binds (an NNX `ModelFns` of `Decoder(cfg, remat=remat)`).
    `inputs(batch)`: a step's batch as a dict of `inputs` (B, S), `targets`, `weights`,
    `segment_ids` and `positions` (None for plain rows; `token_inputs`: a batch of tokens (B, S + 1),
    as the train step's loss takes it); `loss(logits, that dict)`: the loss the step
    differentiates (a scalar mean, or a `TokenSum` over weighted targets). Packed rows: each layer
    attends within its segments and rotates by the batch's positions, as the scanned decoder does.
    `remat`: the layer's policy inside its own vjp, as the scanned decoder applies it per block
    (`layer_gather.block_policy`)."""
    block_def, block_params, block_rest = nnx.split(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0))), nnx.Param, ...)
    blocks_abstract = model_fns.abstract_params["blocks"]

    def bind_rest(rest):
        return model_fns.bind({**rest, "blocks": blocks_abstract})

    def embed(rest, batch):  # -> (B, S, D)
        return bind_rest(rest).embed_tokens(inputs(batch)["inputs"])

    def block(p, h, segment_ids, positions):  # one layer's pure params, (B, S, D) -> (B, S, D)
        st = jax.tree.map(lambda x: x, block_params)
        nnx.replace_by_pure_dict(st, p)
        return layer_gather.gather_module(nnx.merge(block_def, st, block_rest))(h, None, segment_ids, positions)

    def layer(p, h, batch):  # the policy read when traced: it depends on the step's layer-gather context
        b, policy = inputs(batch), layer_gather.block_policy(remat)
        return (block if policy is None else jax.checkpoint(block, policy=policy))(
            p, h, b["segment_ids"], b["positions"]
        )

    def head(rest, h, batch):  # -> the loss over the batch's targets
        return loss(bind_rest(rest)._head(h), inputs(batch))

    return Pieces(embed, layer, head)
