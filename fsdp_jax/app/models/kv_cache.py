"""The decoder's forward over a KV cache: prefill a batch of left-padded prompts, then
decode one token per row per step (`fsdp_jax.app.models.generate` drives it).

Layout. The cache holds keys and values of every layer, `k`, `v`: (L, B, S, K, Dh) in the
params' compute dtype, S = prompt width + new tokens. Prompts are **left-padded**: row b's
prompt fills slots [start_b, P) of a width-P buffer, so every row writes the same slot at
each decode step (one `dynamic_update_slice` per layer, no per-row scatter) and a token's
RoPE position is its slot minus `start_b` (each row's positions start at 0, as in the full
forward of the unpadded row). A query at slot q sees key slot j when start_b <= j <= q (and
q - j < window on a sliding layer); a padding query sees itself only (its output is never
used, and a row of -inf would be NaN).

The layers run as the decoder runs them: a scan over the stacked layers (per-layer param
gathers stay in the loop body under FSDP, `fsdp_jax.train.layer_gather`), MoE segments by
their groups (`models/stack.py`), unscanned layers one by one. The cache is carried through
the scan and written in place, only the new tokens' slots per layer. Attention is XLA's
grouped-query einsum with the softmax in float32 (soft caps included), whatever
`model.attention` says. Every projection takes its LoRA adapter's term, as in training.
Blocks whose attention a family replaces (`models/parts.py`) are refused.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fsdp_jax.app.models import stack
from fsdp_jax.app.models.attention import attend_capped, rope, softcap
from fsdp_jax.app.models.lora import delta
from fsdp_jax.app.models.rope import apply_rope, rope_tables
from fsdp_jax.app.models.self_attention import Attention, constrain
from fsdp_jax.errors import ConfigError
from fsdp_jax.sharding.axes import BATCH, EMBED, KV, KV_HEADS, LAYERS, LENGTH, VOCAB
from fsdp_jax.sharding.precision import matmul, take
from fsdp_jax.train import layer_gather

CACHE_AXES = (LAYERS, BATCH, None, KV_HEADS, KV)  # logical names of the cache's dims


def init_cache(cfg, batch: int, length: int, dtype) -> dict:
    """Zero cache {"k", "v"}: (L, B, S, K, Dh) each."""
    shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
    return {"k": jnp.zeros(shape, dtype), "v": jnp.zeros(shape, dtype)}


def cache_bytes(cfg, batch: int, length: int, itemsize: int) -> int:
    """Bytes of the KV cache of `batch` rows of `length` slots (the memory model's term)."""
    return 2 * cfg.n_layers * batch * length * cfg.n_kv_heads * cfg.head_dim * itemsize


@dataclasses.dataclass(frozen=True)
class _Step:
    """What every layer of one cached forward shares (traced values)."""

    index: jax.Array  # () int32: the cache slot of the first of the T new tokens
    positions: jax.Array  # (B, T) int32 RoPE positions
    mask: jax.Array  # (B, 1, T, S) bool: slots each new token may attend (window aside)
    window: jax.Array | None  # (B, 1, T, S) bool: inside the sliding window, or None
    flags: jax.Array | None  # (L,) bool: sliding layers (a pattern), or None (all alike)


def _masks(cfg, index, t: int, s: int, start):
    q = index + jnp.arange(t)[:, None]  # (T, 1) query slots
    j = jnp.arange(s)[None, :]  # (1, S) key slots
    real = (j >= start[:, None, None]) & (j <= q[None])  # (B, T, S)
    mask = (real | (j == q)[None])[:, None]
    window = None
    if cfg.sliding_window:
        window = jnp.broadcast_to((q - j < cfg.sliding_window)[None, None], mask.shape)
    return mask, window


def _rope(cfg, q, k, positions, local, tables):
    if cfg.rope_type == "default" and not cfg.global_every:  # the decoder's in-graph formula
        return rope(q, positions, cfg.rope_theta), rope(k, positions, cfg.rope_theta)
    cos, sin = tables["global"]
    if local is not None and "local" in tables:
        lc, ls = tables["local"]
        cos, sin = jnp.where(local, lc, cos), jnp.where(local, ls, sin)
    cos, sin = cos[positions], sin[positions]  # (B, T, Dh/2)
    return apply_rope(q, cos, sin), apply_rope(k, cos, sin)


def _plus(y, d):
    return y if d is None else y + d.astype(y.dtype)


def _attend(attn, x, layer, ck, cv, step: _Step, tables):
    """One layer's attention over the cache: x (B, T, D) -> (out (B, T, D), ck, cv) with the
    T new keys/values written at `step.index` of layer `layer` of the full cache."""
    if type(attn) is not Attention:
        raise ConfigError("model.family", "generation runs the decoder's own attention; this family replaces it")
    cfg = attn.cfg
    b, t, d = x.shape
    x2 = x.reshape(-1, d)

    def proj(name, w, bias):
        _, hh, dh = w.shape
        y = _plus(matmul(x2, w.reshape(d, hh * dh)), delta(attn, name, x2)).reshape(b, t, hh, dh)
        return y if bias is None else y + bias[...]

    bias = cfg.qkv_bias
    q = proj("wq", attn.wq[...], attn.bq if bias else None)
    k = proj("wk", attn.wk[...], attn.bk if bias else None)
    v = proj("wv", attn.wv[...], attn.bv if bias else None)
    if cfg.qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    local = None
    if cfg.sliding_window:
        local = jnp.asarray(True) if step.flags is None else step.flags[layer]
    q, k = _rope(cfg, q, k, step.positions, None if step.flags is None else local, tables)
    at = (layer, 0, step.index, 0, 0)
    ck = jax.lax.dynamic_update_slice(ck, k.astype(ck.dtype)[None], at)
    cv = jax.lax.dynamic_update_slice(cv, v.astype(cv.dtype)[None], at)
    keys = jax.lax.dynamic_index_in_dim(ck, layer, keepdims=False)  # (B, S, K, Dh)
    vals = jax.lax.dynamic_index_in_dim(cv, layer, keepdims=False)
    mask = step.mask if local is None else step.mask & (step.window | ~local)
    scale = (cfg.query_pre_attn_scalar or cfg.head_dim) ** -0.5
    o = attend_capped(q, keys.astype(q.dtype), vals.astype(q.dtype), scale, cfg.attn_softcap, mask)
    o2 = o.reshape(b * t, -1)
    out = _plus(matmul(o2, attn.wo[...].reshape(-1, d)), delta(attn, "wo", o2))
    return out.reshape(b, t, d), ck, cv


def _block(blk, x, layer, ck, cv, step, tables):
    """One decoder block (`decoder.Block`) over the cache."""
    x = constrain(x, (BATCH, LENGTH, EMBED))
    a, ck, cv = _attend(blk.attn, blk.attn_norm(x), layer, ck, cv, step, tables)
    x = x + (blk.post_attn_norm(a) if blk.sandwich else a)
    h = blk.mlp_norm(x)
    m = blk.moe(h)[0] if blk.sparse else blk.mlp(h)
    x = x + (blk.post_mlp_norm(m) if blk.sandwich else m)
    return constrain(x, (BATCH, LENGTH, EMBED)), ck, cv


def _unit_blocks(unit):
    """The blocks of one scanned unit: an MoE group's layers, or the block itself."""
    return list(unit.layers) if isinstance(unit, stack.Group) else [unit]


def _run_layers(model, x, cache, step, tables):
    cfg = model.cfg
    ck, cv = cache["k"], cache["v"]
    if not cfg.scan_layers:
        for i, blk in enumerate(model.segments if cfg.n_experts else model.blocks):
            x, ck, cv = _block(blk, x, i, ck, cv, step, tables)
        return x, {"k": ck, "v": cv}

    def unit_fn(unit, carry):
        x, ck, cv, layer = carry
        for blk in _unit_blocks(layer_gather.gather_module(unit)):
            x, ck, cv = _block(blk, x, layer, ck, cv, step, tables)
            layer = layer + 1
        return x, ck, cv, layer

    @nnx.scan(in_axes=(0, nnx.Carry), out_axes=nnx.Carry, transform_metadata={nnx.PARTITION_NAME: LAYERS})
    def run(unit, carry):
        return unit_fn(unit, carry)

    carry = (x, ck, cv, jnp.int32(0))
    for seg in model.segments if cfg.n_experts else [model.blocks]:
        carry = run(seg, carry)  # segments cover the layers in order (models/stack.py)
    x, ck, cv, _ = carry
    return x, {"k": ck, "v": cv}


def forward_cached(model, tokens, cache: dict, index, start):
    """Logits (B, T, V) of `tokens` (B, T) int written at cache slots index .. index+T-1,
    and the updated cache. `model`: a bound `decoder.Decoder`; `start` (B,) int32: each
    row's first real slot (left padding); `index`: () int32."""
    cfg = model.cfg
    b, t = tokens.shape
    s = cache["k"].shape[2]
    index = jnp.asarray(index, jnp.int32)
    positions = jnp.maximum(index + jnp.arange(t)[None, :] - start[:, None], 0).astype(jnp.int32)
    mask, window = _masks(cfg, index, t, s, start)
    flags = None
    if cfg.sliding_window and cfg.global_every:
        flags = jnp.asarray(np.array([cfg.is_local(i) for i in range(cfg.n_layers)]))
    tables = {}
    if cfg.rope_type != "default" or cfg.global_every:
        tables["global"] = rope_tables(cfg, s)
        if cfg.global_every:
            tables["local"] = rope_tables(cfg, s, local=True)
    step = _Step(index, positions, mask, window, flags)
    emb = constrain(model.embed[...], (VOCAB, None))  # (V, D)
    x = take(emb, tokens).astype(emb.dtype)
    if cfg.embed_scale:
        x = x * jnp.asarray(np.float32(cfg.d_model**0.5), emb.dtype)
    x, cache = _run_layers(model, x, cache, step, tables)
    x2 = model.final_norm(x).reshape(b * t, -1)
    head = model.embed[...].T if cfg.tie_word_embeddings else model.head[...]
    logits = softcap(matmul(x2, head).reshape(b, t, -1), cfg.final_softcap)
    cache = {n: constrain(c, CACHE_AXES) for n, c in cache.items()}
    return logits, cache
