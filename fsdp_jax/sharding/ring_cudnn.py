"""The cuDNN block kernel of the flash ring (GPU): cuDNN's fused flash attention per ring
block, forward with its softmax statistics and backward given the ring's global ones.

    kern = cudnn_kernel(scale=Dh ** -0.5)
    o = flash_context_attention(q, k, v, positions, kernel=kern)   # ring_flash

Forward: `jax._src.cudnn.fused_attention_stablehlo.dot_product_attention(...,
return_residual=True)` returns (o_j, lse_j) with lse (B, H, Sq) float32 (its docstring: the
log-sum-exp of FlashAttention-2's section 3.1.1). Backward: the private primitive behind
that function's VJP, `_dot_product_attention_bwd_p_wrapper` (operands q, k, v, bias,
q_seqlen, kv_seqlen, q_offsets, kv_offsets, page_table_k, page_table_v, activation,
fwd_output, grad_output; pinned by tests/test_ring_cudnn.py), bound with activation = the
ring's GLOBAL lse and fwd_output = the GLOBAL o, so the kernel's P = exp(S - lse) and
D = rowsum(dO * o) are the whole row's. Layout BTNH, grouped-query K/V as cuDNN takes them.
A block's mask is CAUSAL (a rank's own block, Sq == Sk) or NO_MASK (the half blocks).

Packed rows (`packed=True`): each block goes to cuDNN in its packed (THD) layout with separate
q and kv segments (`fsdp_jax.sharding.cudnn_packed.block_layout`, computed from the q side's
and the travelling K/V block's segment ids), PADDING_CAUSAL for the own block and PADDING for
the half blocks; queries that meet no key of the block get o 0 and lse -inf, keys that meet no
query no gradient. Both calls bind jax's private primitives directly (`_dot_product_attention_
fwd_p_wrapper` / `_bwd_p_wrapper`): the public function's check for a packed layout asks the
local device for Hopper, which a deviceless compile has not (the kernel is for sm_90+). With
the packed layout jax 0.10 scales BOTH sides' offsets by q's heads x head dim (`_fix_seqlen_offsets`;
jax 0.12 scales K/V's by their own heads), so grouped-query K/V are repeated to q's heads for
those calls and their gradients summed back (right on both; on 0.12 the repeat is not needed).
A block with more than `max_segments` segments gives NaN for its row (a loud failure, which
the trainer's non-finite guard skips) rather than dropping segments.

cuDNN's flash kernels take bfloat16 / float16 q, k, v only. No sliding window (its offset
between zig-zag chunks changes with the ring step) and no soft cap: `cudnn_kernel` raises
ValueError for either; without `packed` its kernel says `segments=False`, so
`flash_context_attention` raises ValueError for segment ids. Tracing the unpacked forward asks
the cuDNN library for its version, so a compile for GPU targets needs NVIDIA's cuDNN wheel
beside the plugin (`python -m fsdp_jax.targets install`).
"""

from __future__ import annotations

import jax.numpy as jnp

from fsdp_jax.sharding.cudnn_packed import block_layout, packed_stats, token_lse
from fsdp_jax.sharding.ring_kernels import BlockKernel

# segments per block cuDNN's packed layout is sized for (stats (B x M, H, Sq) float32 per call)
MAX_SEGMENTS = 128


def _fa():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    return fa


def _version_params() -> dict:
    """The primitives' params that only some jax versions take: jax 0.12 adds flex attention's
    `score_mod` (its `score_mod_args` operands spread after the others: none here), jax 0.10
    has neither (tests/test_ring_cudnn.py pins both)."""
    import inspect

    takes = "score_mod" in inspect.signature(_fa()._dot_product_attention_bwd_impl).parameters
    return {"score_mod": None} if takes else {}


def cudnn_kernel(
    *, scale: float, softcap: float = 0.0, window: int = 0, packed: bool = False, max_segments: int = MAX_SEGMENTS
) -> BlockKernel:
    """The cuDNN `BlockKernel` (module docstring); ValueError for a window or a soft cap.
    `packed`: the blocks take segment ids (cuDNN's packed layout per block)."""
    for name, value in (("sliding window", window), ("soft cap", softcap)):
        if value:
            raise ValueError(f"cuDNN per ring block takes no {name} ({value}); use model.attention=xla")
    if packed:
        return packed_kernel(scale=scale, max_segments=max_segments)

    def mask(causal):
        return _fa().MaskType.CAUSAL if causal else _fa().MaskType.NO_MASK

    def fwd(q, k, v, qp, kp, qs, ks, local, causal):
        del qp, kp, qs, ks, local  # plain causal / full blocks of unpacked rows
        o, lse = _fa().dot_product_attention(
            q, k, v, scale=scale, mask_type=mask(causal), qkv_layout="BTNH", return_residual=True
        )
        return o.astype(jnp.float32), jnp.swapaxes(lse, 1, 2).astype(jnp.float32)  # lse (B, Sq, H)

    def bwd(q, k, v, qp, kp, qs, ks, local, o, lse, do, causal):
        del qp, kp, qs, ks, local
        fa = _fa()
        unused = jnp.zeros(0, dtype=q.dtype)
        grads = fa._dot_product_attention_bwd_p_wrapper.bind(
            q,
            k,
            v,
            unused,  # bias
            unused,  # q_seqlen
            unused,  # kv_seqlen
            unused,  # q_offsets
            unused,  # kv_offsets
            unused,  # page_table_k
            unused,  # page_table_v
            jnp.swapaxes(lse, 1, 2).astype(jnp.float32),  # activation: the global lse (B, H, Sq)
            o.astype(q.dtype),  # fwd_output: the global o
            do.astype(q.dtype),  # grad_output
            scale=scale,
            seed=42,
            dropout_rate=0.0,
            variadic_args=(False, False),  # (has_bias, has_dbias)
            mask_type=mask(causal),
            layout=fa.AttentionLayout.BTNH.value,
            sliding_window_length=None,
            **_version_params(),
        )
        dq, dk, dv = grads[:3]
        return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

    return BlockKernel(fwd, bwd, segments=False)


def _cudnn_fwd(q, k, v, lay, causal, *, scale):
    """cuDNN's forward on one block in its packed layout: (o (B, Sq, H, Dh), stats (B x M, H, Sq))."""
    fa = _fa()
    unused = jnp.zeros(0, dtype=q.dtype)
    o, stats = fa._dot_product_attention_fwd_p_wrapper.bind(
        q, k, v, unused, lay.q_seqlen, lay.kv_seqlen, lay.q_offsets, lay.kv_offsets, unused, unused,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=_packed_mask(causal),
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None, is_training=True, **_version_params(),
    )  # fmt: skip
    return o, stats


def _cudnn_bwd(q, k, v, lay, causal, stats, o, do, *, scale):
    """cuDNN's backward on one block in its packed layout, given packed stats: (dq, dk, dv)."""
    fa = _fa()
    unused = jnp.zeros(0, dtype=q.dtype)
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, lay.q_seqlen, lay.kv_seqlen, lay.q_offsets, lay.kv_offsets, unused, unused,
        stats, o, do,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=_packed_mask(causal),
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=None, **_version_params(),
    )  # fmt: skip
    return grads[:3]


def _packed_mask(causal):
    return _fa().MaskType.PADDING_CAUSAL if causal else _fa().MaskType.PADDING


def _heads(x, h):
    """Grouped-query K/V (B, S, K, Dh) repeated to q's H heads (kv head n // (H / K))."""
    return x if x.shape[2] == h else jnp.repeat(x, h // x.shape[2], axis=2)


def _fold(dx, kvh):
    """Gradients (B, S, H, Dh) of repeated K/V summed back to (B, S, K, Dh)."""
    b, s, h, d = dx.shape
    return dx if h == kvh else dx.reshape(b, s, kvh, h // kvh, d).sum(3)


def packed_kernel(*, scale: float, max_segments: int = MAX_SEGMENTS, backend=None) -> BlockKernel:
    """The cuDNN `BlockKernel` for packed rows (module docstring). `backend` = (fwd, bwd) with
    `_cudnn_fwd` / `_cudnn_bwd`'s signatures replaces cuDNN (the CPU tests' emulation)."""
    call_fwd, call_bwd = backend or (_cudnn_fwd, _cudnn_bwd)

    def fwd(q, k, v, qp, kp, qs, ks, local, causal):
        del qp, kp, local
        lay = block_layout(qs, ks, max_segments=max_segments)
        h = q.shape[2]
        o, stats = call_fwd(q, _heads(k, h), _heads(v, h), lay, causal, scale=scale)
        seen = (lay.q_seg >= 0)[..., None]
        o = jnp.where(seen[..., None], o.astype(jnp.float32), 0.0)
        o = jnp.where(lay.overflow[:, None, None, None], jnp.nan, o)
        return o, token_lse(stats, lay)

    def bwd(q, k, v, qp, kp, qs, ks, local, o, lse, do, causal):
        del qp, kp, local
        lay = block_layout(qs, ks, max_segments=max_segments)
        h, kvh = q.shape[2], k.shape[2]
        stats = packed_stats(lse, lay)  # the ring's global lse in cuDNN's packed layout
        dq, dk, dv = call_bwd(
            q, _heads(k, h), _heads(v, h), lay, causal, stats, o.astype(q.dtype), do.astype(q.dtype), scale=scale
        )
        dq = jnp.where((lay.q_seg >= 0)[..., None, None], dq.astype(jnp.float32), 0.0)
        kv_seen = lay.kv_covered[..., None, None]
        dk = jnp.where(kv_seen, _fold(dk.astype(jnp.float32), kvh), 0.0)
        dv = jnp.where(kv_seen, _fold(dv.astype(jnp.float32), kvh), 0.0)
        return dq, dk, dv

    return BlockKernel(fwd, bwd)
