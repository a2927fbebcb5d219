"""Splash attention on TPU targets (`model.attention: splash`): JAX's Pallas flash
attention kernel (`jax.experimental.pallas.ops.tpu.splash_attention`), causal, with packed
rows' segment ids, sliding windows (a layer pattern's local flag picks the local or the
global kernel) and soft-capped scores; no S x S logits are kept.

q (B, S, H, Dh), k / v (B, S, K, Dh) -> (B, S, H, Dh). Grouped-query heads run as the
kernel's multi-query form, one call per (row, kv head) with its H / K query heads. A
Pallas call is not partitioned by XLA, so the kernel runs under `shard_map`, each device
on its own rows and heads as the logical rules split them (the sequence stays whole:
splash does not combine with `mesh.context`). Mosaic compiles it for TPU only; on other
backends the trainer's checks stop the run first (`model.attention`).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.sharding import PartitionSpec as P

from fsdp_jax.sharding.axes import BATCH, HEADS, KV, KV_HEADS
from fsdp_jax.sharding.rules import flax_rules


@functools.lru_cache(maxsize=None)
def _kernel(seq_len: int, heads: int, window: int, softcap: float):
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    if window:
        mask = sa.LocalMask((seq_len, seq_len), (window - 1, 0), 0)
    else:
        mask = sa.CausalMask((seq_len, seq_len))
    blk = min(512, seq_len)
    sizes = sa.BlockSizes(
        block_q=blk, block_kv=blk, block_kv_compute=blk, block_q_dkv=blk, block_kv_dkv=blk,
        block_kv_dkv_compute=blk, block_q_dq=blk, block_kv_dq=blk,
    )  # fmt: skip
    return sa.make_splash_mqa_single_device(
        sa.MultiHeadMask([mask] * heads), block_sizes=sizes, attn_logits_soft_cap=softcap or None
    )


def _local(q, k, v, seg, local, *, scale, window, softcap):
    """Per device: q (b, S, h, Dh), k / v (b, S, kv, Dh), seg (b, S)."""
    from jax.experimental.pallas.ops.tpu import splash_attention as sa

    b, s, h, dh = q.shape
    kvh = k.shape[2]
    qg = (q * jnp.asarray(scale, q.dtype)).reshape(b, s, kvh, h // kvh, dh).transpose(0, 2, 3, 1, 4)  # b, kv, g, S, Dh
    kk, vv = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # (b, kv, S, Dh)

    def run(kernel):
        def one(qh, kh, vh, sg):
            return kernel(qh, kh, vh, segment_ids=sa.SegmentIds(q=sg, kv=sg))

        per_row = jax.vmap(one, in_axes=(0, 0, 0, None))  # over kv heads
        return jax.vmap(per_row)(qg, kk, vv, seg)  # over rows: (b, kv, g, S, Dh)

    glob = functools.partial(run, _kernel(s, h // kvh, 0, softcap))
    if window and local is None:
        o = run(_kernel(s, h // kvh, window, softcap))
    elif window:
        o = jax.lax.cond(local, lambda: run(_kernel(s, h // kvh, window, softcap)), glob)
    else:
        o = glob()
    return o.transpose(0, 3, 1, 2, 4).reshape(b, s, h, dh)


def splash_attention(q, k, v, segment_ids=None, *, scale: float, window: int = 0, local=None, softcap: float = 0.0):
    """Causal splash attention (module docstring); `segment_ids` None: one segment per row."""

    seg = jnp.ones(q.shape[:2], jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    rules = nn.get_logical_axis_rules() or flax_rules()
    names = ((BATCH, None, HEADS, KV), (BATCH, None, KV_HEADS, KV), (BATCH, None))
    qs, kvs, ss = (P(*nn.logical_to_mesh_axes(n, rules)) for n in names)
    body = functools.partial(_local, scale=scale, window=window, softcap=softcap)
    flag = jnp.asarray(True) if local is None else jnp.asarray(local)
    fn = jax.shard_map(
        lambda q, k, v, s, f: body(q, k, v, s, None if local is None else f),
        in_specs=(qs, kvs, kvs, ss, P()),
        out_specs=qs,
        check_vma=False,
    )
    return fn(q, k, v, seg, flag)
