"""Expert parallelism over a batch axis: the (token, expert) pairs travel to the device that
holds their expert by all-to-all, and their outputs travel back the same way.

Inside the `shard_map` of `moe_dispatch.per_batch_shard`, each of the n_ep devices of the
expert axes (e.g. `mesh.rules: {expert: data}`) holds its own tokens (the batch is split
over those axes too) and E_l = E / n_ep experts, the ones from shard_index x E_l. One
`jax.lax.all_to_all` over the expert axes sends every pair's token to its expert's device,
the experts run there, and a second sends the outputs back. The buffers are dense (static
shapes); XLA:CPU has no `ragged-all-to-all` (jax 0.10.2: "HLO opcode ragged-all-to-all is
not supported by XLA:CPU ThunkEmitter"):
- dropless (`exchange_dropless`): each device sends each shard a block of N*k rows (room
  for all its pairs going to one shard), ordered by destination; the receiver runs its
  experts' rows as grouped matmuls (`grouped_matmul`), the empty rows in no group. Every pair
  arrives: the result equals the one-device dropless layer.
- dropless over `jax.lax.ragged_all_to_all` (`exchange_dropless_ragged`, `model.expert_exchange:
  ragged`; GPU / TPU): only the routed rows travel, into the same receive layout.
- capacity (`exchange_capacity`): the device's (E, C, D) buffer of `with_capacity` (at most
  C of its tokens per expert, token order wins) is cut by expert shard, so each shard
  receives (n_ep, E_l, C, D) and runs batched matmuls over n_ep x C rows per expert: the
  same tokens are kept and dropped as without expert parallelism (C is per batch shard).
Both return this device's tokens' outputs (N, D) and the dropped pairs (f32).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fsdp_jax.app.models.moe_dispatch import (
    ExpertLora,
    GroupedDot,
    batched,
    batched_rows,
    capacity_slots,
    experts_ffn,
    group_rows,
)


def _a2a(x, axes):
    """(n_ep, ...) blocks: block j goes to shard j; block i of the result came from shard i."""
    return jax.lax.all_to_all(x, axes, 0, 0)


def exchange_dropless(
    x2, w, idx, ws, axes, n_ep: int, lora: ExpertLora | None = None, impl: str = "auto", ffn=experts_ffn
):
    """x2 (N, D), w and idx (N, k) of this device; ws: wg, wu (E_l, D, F), wd (E_l, F, D) its
    experts, then their adapters (or what `ffn` takes: `moe_dispatch.experts_ffn`)."""
    n, k = idx.shape
    el, d = ws[0].shape[0], x2.shape[1]
    m = n * k
    flat = idx.reshape(-1)  # (N*k,) global expert ids
    dest = flat // el
    onehot = jax.nn.one_hot(dest, n_ep, dtype=jnp.int32)  # (N*k, n_ep)
    pos = jnp.sum((jnp.cumsum(onehot, axis=0) - onehot) * onehot, axis=-1)  # rank among the pairs to dest
    slot = dest * m + pos  # distinct rows of the (n_ep * m) send buffer
    send_x = jnp.zeros((n_ep * m, d), x2.dtype).at[slot].set(x2[jnp.arange(m) // k]).reshape(n_ep, m, d)
    send_e = jnp.full((n_ep * m,), el, jnp.int32).at[slot].set(flat % el).reshape(n_ep, m)
    rx, re = _a2a(send_x, axes).reshape(n_ep * m, d), _a2a(send_e, axes).reshape(-1)  # rows from every shard
    order = jnp.argsort(re, stable=True)  # by local expert; empty rows (id E_l) last, in no group
    sizes = jnp.bincount(re, length=el + 1)[:el].astype(jnp.int32)
    xs = rx[order]
    ys = ffn(xs, ws, lora, GroupedDot(sizes, impl), group_rows(sizes, n_ep * m))
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(n_ep, m, d)
    back = _a2a(y, axes).reshape(n_ep * m, d)[slot].reshape(n, k, d)  # each pair's output, home again
    return jnp.einsum("nkd,nk->nd", back, w.astype(back.dtype)), jnp.zeros((), jnp.float32)


def exchange_capacity(
    x2, w, idx, ws, axes, n_ep: int, cap: int, n_experts: int, lora: ExpertLora | None = None, ffn=experts_ffn
):
    """As `exchange_dropless`, at most `cap` of this device's tokens per expert."""
    el, d = ws[0].shape[0], x2.shape[1]
    _, keep, slot, tok = capacity_slots(idx, cap, n_experts)
    xpad = jnp.concatenate([x2, jnp.zeros((1, d), x2.dtype)])
    buf = xpad[tok[:-1]].reshape(n_ep, el * cap, d)  # by expert shard; empty rows are zeros
    rb = _a2a(buf, axes).reshape(n_ep, el, cap, d).transpose(1, 0, 2, 3).reshape(el, n_ep * cap, d)
    yb = ffn(rb, ws, lora, batched, batched_rows).reshape(el, n_ep, cap, d).transpose(1, 0, 2, 3)
    yb = _a2a(yb.reshape(n_ep, el * cap, d), axes).reshape(n_experts * cap, d)
    y = jnp.concatenate([yb, jnp.zeros((1, d), yb.dtype)])[slot]  # (N, k, D); dropped pairs read 0
    out = jnp.einsum("nkd,nk->nd", y, (w * keep).astype(y.dtype))
    return out, jnp.sum(~keep).astype(jnp.float32)


def _ragged(x, out, in_off, send, out_off, recv, axes):
    return jax.lax.ragged_all_to_all(x, out, in_off, send, out_off, recv, axis_name=axes)


def exchange_dropless_ragged(
    x2, w, idx, ws, axes, n_ep: int, lora: ExpertLora | None = None, impl: str = "auto", ffn=experts_ffn
):
    """`exchange_dropless` with `jax.lax.ragged_all_to_all` (`model.expert_exchange: ragged`;
    GPU and TPU only, XLA:CPU cannot run it): each device sends each shard only the pairs routed
    to it, so the wire carries N*k rows per device instead of n_ep blocks of N*k. The receive
    buffer keeps the dense layout (sender i's rows from row i*N*k: room for every pair of every
    shard, as dropless needs), so the compute after it is `exchange_dropless`'s."""
    n, k = idx.shape
    el, d = ws[0].shape[0], x2.shape[1]
    m = n * k
    flat = idx.reshape(-1)  # (N*k,) global expert ids
    dest = flat // el
    order = jnp.argsort(dest, stable=True)  # the pairs by destination shard
    send = jnp.bincount(dest, length=n_ep).astype(jnp.int32)  # (n_ep,) rows to each shard
    in_off = (jnp.cumsum(send) - send).astype(jnp.int32)
    me = jax.lax.axis_index(axes)
    block = jnp.full((n_ep,), me * m, jnp.int32)  # where my rows land in every receiver
    recv = _a2a(send, axes)  # (n_ep,) rows from each shard
    xs, es = x2[order // k], (flat % el)[order]
    rx = _ragged(xs, jnp.zeros((n_ep * m, d), x2.dtype), in_off, send, block, recv, axes)
    re = _ragged(es, jnp.full((n_ep * m,), el, jnp.int32), in_off, send, block, recv, axes)
    by_e = jnp.argsort(re, stable=True)  # by local expert; empty rows (id E_l) last, in no group
    sizes = jnp.bincount(re, length=el + 1)[:el].astype(jnp.int32)
    ys = ffn(rx[by_e], ws, lora, GroupedDot(sizes, impl), group_rows(sizes, n_ep * m))
    y = jnp.zeros_like(ys).at[by_e].set(ys)  # (n_ep * N*k, D) in the receive layout
    # back: block i's first recv[i] rows to shard i, at the offset it sent them from
    home = _a2a(in_off, axes)  # (n_ep,) where in shard i's buffer its rows to me started
    src = (jnp.arange(n_ep, dtype=jnp.int32) * m).astype(jnp.int32)
    back = _ragged(y, jnp.zeros((m, d), y.dtype), src, recv, home, send, axes)  # (N*k, D) by destination
    out = jnp.zeros_like(back).at[order].set(back).reshape(n, k, d)  # each pair's output, home again
    return jnp.einsum("nkd,nk->nd", out, w.astype(out.dtype)), jnp.zeros((), jnp.float32)
