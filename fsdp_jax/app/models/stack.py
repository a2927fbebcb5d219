"""Layers of a mixture-of-experts decoder, sparse and dense interleaved, stacked and scanned.

Which layers are sparse is transformers' rule (Qwen2MoeDecoderLayer / Qwen3MoeDecoderLayer,
Mixtral with every layer sparse): layer i is sparse iff n_experts > 0, i is not in
`mlp_only_layers` and (i + 1) % decoder_sparse_step == 0.

Stacked params need one shape per stack, so the layers are cut into *segments*, each a
stack of identical *groups* of consecutive layers, scanned over its groups:
- periodic: the pattern repeats every p layers (p divides n_layers): one segment of
  n_layers / p groups of p layers (all sparse: p = 1; decoder_sparse_step=2: p = 2);
- otherwise runs: one segment per maximal run of layers of one kind, groups of 1 layer;
whichever unrolls fewer layers in the scan bodies (p against the number of runs; a tie
goes to the one segment).
Params live at `segments/<j>/layers/<m>/...` with a leading `layers` dim (the group
index); layer index = start_j + group * p_j + m (`segment_layers`). The per-layer (here:
per-group) cast and gather of `fsdp_jax.train.layer_gather` runs inside the scan body.
LoRA adapters (`fsdp_jax.app.models.lora`) are attached after a group's layers (unscanned:
by the decoder after its last param), so the base params are drawn as without them; each layer's dropout key is
the decoder's layer key of its layer index.
"""

from __future__ import annotations

from collections.abc import Callable

import jax.numpy as jnp
from flax import nnx

from fsdp_jax.app.models.lora import attach
from fsdp_jax.app.models.lora_dropout import layer_keys
from fsdp_jax.app.models.moe import add_layer, zero_stats
from fsdp_jax.sharding.axes import LAYERS
from fsdp_jax.train import layer_gather


def sparse_layers(cfg) -> tuple[bool, ...]:
    """Per layer: whether its MLP is the mixture of experts (`DecoderConfig.sparse_layers`)."""
    return cfg.sparse_layers()


def segments(cfg) -> tuple[tuple[int, tuple[bool, ...], int], ...]:
    """((first layer, sparse flags of one group, number of groups), ...) covering the layers in
    order. A layer's kind is its sparse flag and its sliding flag (`cfg.is_local`: a pattern of
    sliding and full layers), so layer m of every group of a segment slides alike."""
    kinds = sparse_layers(cfg)
    n = len(kinds)
    key = [(kinds[i], cfg.is_local(i)) for i in range(n)]
    period = next(p for p in range(1, n + 1) if n % p == 0 and all(key[i] == key[i % p] for i in range(n)))
    runs: list[tuple[int, tuple[bool, ...], int]] = []
    for i, k in enumerate(kinds):
        if runs and key[runs[-1][0]] == key[i]:
            runs[-1] = (runs[-1][0], (k,), runs[-1][2] + 1)
        else:
            runs.append((i, (k,), 1))
    if period <= len(runs):
        return ((0, kinds[:period], n // period),)
    return tuple(runs)


def local_flag(cfg, layer: int):
    """Layer `layer`'s sliding flag for its attention (a layer pattern, `global_every`), else None."""
    return jnp.asarray(cfg.is_local(layer)) if cfg.sliding_window and cfg.global_every else None


def segment_layers(cfg) -> list[tuple[str, list[int], bool]]:
    """[(param path prefix, the layer index of each stacked entry, sparse)] for scanned
    layers, or one row per layer ("blocks/<i>") when `scan_layers` is off."""
    if not cfg.scan_layers:
        return [(f"segments/{i}", [i], s) for i, s in enumerate(sparse_layers(cfg))]
    out = []
    for j, (start, kinds, count) in enumerate(segments(cfg)):
        p = len(kinds)
        for m, s in enumerate(kinds):
            out.append((f"segments/{j}/layers/{m}", [start + g * p + m for g in range(count)], s))
    return out


class Group(nnx.Module):
    """Consecutive layers, applied in order; each block returns (x, RouterStats)."""

    def __init__(self, cfg, rngs: nnx.Rngs, kinds: tuple[bool, ...], make_block: Callable, lora=None, start: int = 0):
        self.layers = nnx.List([make_block(cfg, rngs, sparse) for sparse in kinds])
        self.cfg, self.start = cfg, start  # layer m of each group slides as layer start + m
        if lora is not None:  # last: the base params are drawn as without adapters
            for blk in self.layers:
                attach(blk, cfg, lora, rngs)

    def __call__(self, x, stats, segment_ids=None, positions=None, token_mask=None, keys=None, layers=None):
        # keys: (p,) the layers' dropout keys, or None; layers: (p,) their layer indices
        for m, blk in enumerate(self.layers):
            loc = local_flag(self.cfg, self.start + m)
            x, s = blk(x, loc, segment_ids, positions, token_mask, None if keys is None else keys[m])
            stats = add_layer(stats, s, layers[m])
        return x, stats


def make_layers(cfg, rngs: nnx.Rngs, make_block: Callable, lora=None):
    """`nnx.List` of stacked `Group`s (scan_layers) or of one block per layer.
    `make_block(cfg, rngs, sparse)` builds one decoder block; `lora`: adapters on each
    stacked group (unscanned blocks get theirs from the decoder, after its last param)."""
    if not cfg.scan_layers:
        return nnx.List([make_block(cfg, rngs, s) for s in sparse_layers(cfg)])
    return nnx.List(
        [_stacked(cfg, rngs, kinds, count, make_block, lora, start) for start, kinds, count in segments(cfg)]
    )


def _stacked(cfg, rngs: nnx.Rngs, kinds: tuple[bool, ...], count: int, make_block: Callable, lora, start: int):
    @nnx.split_rngs(splits=count)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def make(r):
        return Group(cfg, r, kinds, make_block, lora, start)

    return make(rngs)


def run_layers(cfg, layers, x, remat: str, segment_ids=None, positions=None, token_mask=None, dropout_key=None):
    """x (B, S, D) through every layer -> (x, RouterStats summed over the sparse layers, with
    each layer's counts in `layer_counts` (L, E)); `dropout_key`: the adapters' dropout (layer
    l's key `lora_dropout.layer_keys(key, L)[l]`)."""
    stats = zero_stats(cfg.n_experts, cfg.n_layers)
    policy = layer_gather.block_policy(remat)
    keys = layer_keys(dropout_key, cfg.n_layers)  # (L,) or None
    if not cfg.scan_layers:
        fn = lambda blk, h, loc, k: blk(h, loc, segment_ids, positions, token_mask, k)  # noqa: E731
        fn = fn if policy is None else nnx.remat(fn, policy=policy)
        for i, blk in enumerate(layers):
            x, s = fn(blk, x, local_flag(cfg, i), None if keys is None else keys[i])
            stats = add_layer(stats, s, i)
        return x, stats
    group_fn = lambda g, c, k: layer_gather.gather_module(g)(*c, segment_ids, positions, token_mask, *k)  # noqa: E731
    group_fn = group_fn if policy is None else nnx.remat(group_fn, policy=policy)

    @nnx.scan(in_axes=(0, nnx.Carry, 0), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def run(g, carry, k):
        return group_fn(g, carry, k)

    carry = (x, stats)
    for seg, (start, kinds, count) in zip(layers, segments(cfg)):
        p = len(kinds)  # group g's layer m is layer start + g * p + m
        idx = start + jnp.arange(count)[:, None] * p + jnp.arange(p)[None, :]
        carry = run(seg, carry, (None if keys is None else keys[idx], idx))
    return carry
