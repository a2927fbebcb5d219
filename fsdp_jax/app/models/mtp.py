"""Multi-token prediction modules (DeepSeek-V3 technical report, sec. 2.2), `model.mtp_depth` > 0.

Depth k = 1..D predicts token t_{i+k+1} at position i. Its module takes depth k-1's hidden
h^{k-1} (B, S, D) (depth 0: the main model's last hidden, before its final norm) and the
embedding of token t_{i+k} (the shared table), and computes

    h'^k = M_k [RMSNorm_e(Emb(t_{i+k})); RMSNorm_h(h^{k-1})]      (2D -> D, `eh_proj`)
    h^k  = Block_k(h'^k)                                            (one decoder block)
    logits^k = Head(RMSNorm_k(h^k))                                 (the shared head)

The concatenation puts the embedding first, as DeepSeek-V3's checkpoint stores `eh_proj`
(vLLM's and Megatron's MTP layers read it so; the report's equation writes the hidden first).
Shapes stay (B, S): token t_{i+k} is the input row shifted left by k, and the last k positions,
which have no such token, are masked out of the loss (`fsdp_jax.app.objectives.mtp`), as
MaxText's `roll_and_mask` and Megatron's `roll_tensor` do. The block is the decoder's block for
layer index n_layers + k - 1 (sparse by the decoder's rule, its sliding flag by the pattern):
DeepSeek-V3's checkpoint keeps it as `model.layers.<n_layers + k - 1>`.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from fsdp_jax.app.models.norm import RMSNorm, normal_param
from fsdp_jax.app.models.self_attention import constrain, flat_rows
from fsdp_jax.sharding.axes import BATCH, EMBED, LENGTH, MLP
from fsdp_jax.sharding.precision import matmul


def shift_left(x, k: int, fill=0):
    """x (B, S, ...) with row i holding x[i + k]; the last k rows `fill`."""
    pad = jnp.full((x.shape[0], k) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, k:], pad], axis=1)


class MtpLayer(nnx.Module):
    """Depth k's module: the two norms, `eh_proj` (2D, D), `block` (a decoder block), its own
    output norm (`shared_head.norm`). Its input dim of eh_proj names `mlp` (column-parallel
    under tensor parallelism, as Megatron's), its output `embed` (over fsdp)."""

    def __init__(self, cfg, rngs: nnx.Rngs, block: nnx.Module, layer: int):
        po = cfg.norm_plus_one
        self.enorm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
        self.hnorm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
        self.eh_proj = normal_param(rngs, (2 * cfg.d_model, cfg.d_model), (MLP, EMBED))
        self.block = block
        self.norm = RMSNorm(cfg.d_model, cfg.norm_eps, po, rngs)
        self.layer = layer  # its layer index (n_layers + k - 1)
        self.local = cfg.is_local(layer) if cfg.sliding_window and cfg.global_every else None  # a pattern's flag

    def __call__(self, h, e, block_fn):
        """h: depth k-1's hidden (B, S, D); e: the embeddings of t_{i+k} (B, S, D);
        `block_fn(block, x, local_flag)` runs the block (with remat, masks, positions)
        -> (h^k (B, S, D), router stats or None)."""
        b, s, d = h.shape
        x = jnp.concatenate([self.enorm(e), self.hnorm(h)], axis=-1)  # (B, S, 2D)
        x = matmul(flat_rows(x), self.eh_proj[...]).reshape(b, s, d)
        x = constrain(x, (BATCH, LENGTH, EMBED))
        return block_fn(self.block, x, None if self.local is None else jnp.asarray(self.local))


def make_mtp(cfg, rngs: nnx.Rngs, make_block) -> nnx.List:
    """The D depth modules; `make_block(cfg, rngs, sparse)` as the decoder builds a block."""
    out = []
    for k in range(1, cfg.mtp_depth + 1):
        layer = cfg.n_layers + k - 1
        out.append(MtpLayer(cfg, rngs, make_block(cfg, rngs, cfg.is_sparse(layer)), layer))
    return nnx.List(out)


def mtp_params(cfg) -> int:
    """Params of the MTP modules beside their blocks: two input norms, eh_proj, the output norm."""
    d = cfg.d_model
    return cfg.mtp_depth * (3 * d + 2 * d * d)
