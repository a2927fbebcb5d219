"""Flash attention per ring block: context-parallel causal attention whose blocks run a
flash kernel (splash on TPU, cuDNN on GPU, a pure-JAX reference on CPU: `RING_KERNELS`),
under one custom VJP over the whole ring.

    kern = reference_kernel(scale=Dh ** -0.5)        # or splash_kernel / cudnn_kernel
    o = flash_context_attention(q, k, v, positions, segment_ids, kernel=kern)

Shapes, layout and sharding as `fsdp_jax.attention.ring.context_attention`:
q (B, S, H, Dh), k / v (B, S, K, Dh), positions and segment ids (B, S), rows in the
zig-zag order of `fsdp_jax.sharding.context`, S sharded over `context`.

Forward, per rank i: step 0 is its own block (causal over slots); at step t it meets
rank j = i - t's block, whose zig-zag half is either all of i's queries against j's
first-half keys (j < i) or i's second-half queries against all of j's keys (j > i), both
unmasked but for segments and windows (a `lax.cond` on the ring index). Each block's
kernel returns (o_j, lse_j); blocks merge by log-sum-exp, so no rank holds more than the
kernel's own tiles. Residuals: q, k, v, the ids, the output o and its lse. A kernel with a
sliding window (`BlockKernel.window`: splash, cuDNN) meets each block as chunk pairs instead,
each with its static band picked by a `lax.switch` on the rank (`fsdp_jax.attention.windows`).

Backward: the same steps again, each block's kernel backward given the GLOBAL o and lse
(so P and rowsum(dO * o) are the whole row's): dq adds up on the rank, dk / dv of block
j travel with the block around the ring (`ppermute`) and reach their owner after the
last step. With `kv_pass="all_gather"` the blocks are slices of one all-gather of K/V
and dk / dv return with one reduce-scatter (`psum_scatter`) over `context`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from fsdp_jax.attention.cudnn import cudnn_kernel
from fsdp_jax.attention.kernels import BlockKernel, merge, reference_kernel
from fsdp_jax.attention.ring import KV_PASSES, context_specs
from fsdp_jax.attention.splash_block import splash_kernel
from fsdp_jax.attention.windows import window_bwd, window_fwd, window_plan
from fsdp_jax.sharding.axes import CONTEXT
from fsdp_jax.sharding.context import context_size

# `model.attention` -> the block kernel of its flash ring (each takes scale, softcap, window)
RING_KERNELS = {"reference": reference_kernel, "splash": splash_kernel, "cudnn": cudnn_kernel}


def _step_fwd(kern, qq, kv, local, j, i):
    """(o_j, lse_j) of rank j's block on rank i (j != i): the half zig-zag leaves."""
    q, qp, qs = qq
    k, v, kp, ks = kv
    half = q.shape[1] // 2

    def earlier(_):
        return kern.fwd(q, k[:, :half], v[:, :half], qp, kp[:, :half], qs, ks[:, :half], local, False)

    def later(_):
        o, lse = kern.fwd(q[:, half:], k, v, qp[:, half:], kp, qs[:, half:], ks, local, False)
        return jnp.concatenate([jnp.zeros_like(o), o], 1), jnp.concatenate([jnp.full_like(lse, -jnp.inf), lse], 1)

    return jax.lax.cond(j < i, earlier, later, None)


def _step_bwd(kern, qq, kv, local, out, j, i):
    """(dq, dk, dv) of rank j's block on rank i (j != i), float32; `out` = (o, lse, do)."""
    q, qp, qs = qq
    k, v, kp, ks = kv
    o, lse, do = out
    half = q.shape[1] // 2

    def earlier(_):
        dq, dk, dv = kern.bwd(q, k[:, :half], v[:, :half], qp, kp[:, :half], qs, ks[:, :half], local, o, lse, do, False)
        pad = jnp.zeros_like(dk)
        return dq, jnp.concatenate([dk, pad], 1), jnp.concatenate([dv, pad], 1)

    def later(_):
        h = slice(half, None)
        dq, dk, dv = kern.bwd(q[:, h], k, v, qp[:, h], kp, qs[:, h], ks, local, o[:, h], lse[:, h], do[:, h], False)
        return jnp.concatenate([jnp.zeros_like(dq), dq], 1), dk, dv

    return jax.lax.cond(j < i, earlier, later, None)


def _blocks(kv, n, kv_pass):
    """(j, rank j's K/V block) for each step t >= 1 on this rank (j = i - t): ring hops or
    slices of one gather."""
    i = jax.lax.axis_index(CONTEXT)
    ring = [(r, (r + 1) % n) for r in range(n)]
    if kv_pass == "all_gather":
        full = jax.lax.all_gather(kv, CONTEXT, axis=1, tiled=True)
        sc = kv[0].shape[1]
    for t in range(1, n):
        j = (i - t) % n
        if kv_pass == "ring":
            kv = jax.lax.ppermute(kv, CONTEXT, ring)
        else:
            kv = tuple(jax.lax.dynamic_slice_in_dim(x, j * sc, sc, axis=1) for x in full)
        yield j, kv


def _plan(kern, n, q, pattern):
    """The windowed ring's chunk-pair plan (`ring_window`) for a kernel with a window, else None."""
    return window_plan(n=n, c=q.shape[1] // 2, window=kern.window, pattern=pattern) if kern.window else None


def _forward(kern, n, kv_pass, pattern, q, k, v, qp, kp, qs, ks, local):
    i = jax.lax.axis_index(CONTEXT)
    plan, qq = _plan(kern, n, q, pattern), (q, qp, qs)
    if plan is None:
        acc = kern.fwd(q, k, v, qp, kp, qs, ks, local, True)  # own block: causal over slots
    else:
        acc = window_fwd(kern, plan, 0, qq, (k, v, kp, ks), local, i)
    for t, (j, kv) in enumerate(_blocks((k, v, kp, ks), n, kv_pass), 1):
        step = _step_fwd(kern, qq, kv, local, j, i) if plan is None else window_fwd(kern, plan, t, qq, kv, local, i)
        acc = merge(acc, step)
    o, lse = acc
    return o.astype(q.dtype), lse


def _backward(kern, n, kv_pass, pattern, res, do):
    q, k, v, qp, kp, qs, ks, local, o, lse = res
    i = jax.lax.axis_index(CONTEXT)
    out = (o, lse, do)
    plan, qq = _plan(kern, n, q, pattern), (q, qp, qs)
    if plan is None:
        dq, dk, dv = kern.bwd(q, k, v, qp, kp, qs, ks, local, o, lse, do, True)
    else:
        dq, dk, dv = window_bwd(kern, plan, 0, qq, (k, v, kp, ks), local, out, i)
    ring = [(r, (r + 1) % n) for r in range(n)]
    sc = k.shape[1]
    if kv_pass == "all_gather":  # one (B, S, K, Dh) f32 buffer per rank, reduce-scattered at the end
        full = [jnp.zeros((x.shape[0], n * sc, *x.shape[2:]), jnp.float32) for x in (k, v)]
        full = [jax.lax.dynamic_update_slice_in_dim(f, g, i * sc, axis=1) for f, g in zip(full, (dk, dv))]
    dkv = (dk, dv)
    for t, (j, kv) in enumerate(_blocks((k, v, kp, ks), n, kv_pass), 1):
        if kv_pass == "ring":  # block j's gradients travel with block j
            dkv = jax.lax.ppermute(dkv, CONTEXT, ring)
        if plan is None:
            dq_j, dk_j, dv_j = _step_bwd(kern, qq, kv, local, out, j, i)
        else:
            dq_j, dk_j, dv_j = window_bwd(kern, plan, t, qq, kv, local, out, i)
        dq = dq + dq_j
        if kv_pass == "ring":
            dkv = (dkv[0] + dk_j, dkv[1] + dv_j)
        else:
            full = [
                jax.lax.dynamic_update_slice_in_dim(f, jax.lax.dynamic_slice_in_dim(f, j * sc, sc, 1) + g, j * sc, 1)
                for f, g in zip(full, (dk_j, dv_j))
            ]
    if kv_pass == "ring":
        dk, dv = jax.lax.ppermute(dkv, CONTEXT, ring) if n > 1 else dkv  # home: rank i gets block i's
    else:
        dk, dv = (jax.lax.psum_scatter(f, CONTEXT, scatter_dimension=1, tiled=True) for f in full)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


def _local_ring(q, k, v, qp, kp, qs, ks, local, *, kern, n, kv_pass, pattern):
    """The per-rank body under shard_map: one custom VJP over the whole ring."""

    @jax.custom_vjp
    def attend(q, k, v, qp, kp, qs, ks, local):
        return _forward(kern, n, kv_pass, pattern, q, k, v, qp, kp, qs, ks, local)[0]

    def fwd(q, k, v, qp, kp, qs, ks, local):
        o, lse = _forward(kern, n, kv_pass, pattern, q, k, v, qp, kp, qs, ks, local)
        return o, (q, k, v, qp, kp, qs, ks, local, o, lse)

    def bwd(res, do):
        return (*_backward(kern, n, kv_pass, pattern, res, do), None, None, None, None, None)

    attend.defvjp(fwd, bwd)
    return attend(q, k, v, qp, kp, qs, ks, local)


def flash_context_attention(
    q, k, v, positions, segment_ids=None, *, kernel: BlockKernel, local=None, kv_pass: str = "all_gather"
):
    """Causal attention of zig-zag rows sharded over `context`, each ring block computed
    by `kernel` (module docstring). `kernel` carries scale, soft cap and window (a kernel with
    `window` set runs the chunk-pair steps of `ring_window`); `local` a traced bool scalar
    (the window applies when True) or None (always)."""
    if kv_pass not in KV_PASSES:
        raise ValueError(f"kv_pass {kv_pass!r}: choose one of {', '.join(KV_PASSES)}")
    if not isinstance(kernel, BlockKernel):
        raise TypeError(f"kernel must be a BlockKernel(fwd, bwd), not {type(kernel).__name__}")
    if segment_ids is not None and not kernel.segments:
        raise ValueError("this ring block kernel takes no segment ids (packed rows); use model.attention=xla")
    if positions is None:
        raise ValueError("flash_context_attention needs positions (B, S): rows are in zig-zag order")
    seg = jnp.zeros(positions.shape, jnp.int32) if segment_ids is None else segment_ids.astype(jnp.int32)
    flag = jnp.asarray(True) if local is None else jnp.asarray(local)
    body = functools.partial(_local_ring, kern=kernel, n=context_size(), kv_pass=kv_pass, pattern=local is not None)
    qs, kvs, seq = context_specs()
    fn = jax.shard_map(body, in_specs=(qs, kvs, kvs, seq, seq, seq, seq, P()), out_specs=qs, check_vma=False)
    return fn(q, k, v, positions, positions, seg, seg, flag)
