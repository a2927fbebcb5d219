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

cuDNN's flash kernels take bfloat16 / float16 q, k, v only. No packed rows' segment ids (the
ring's half blocks would need cuDNN's packed layout with paired segments across two chunks),
no sliding window (its offset between zig-zag chunks changes with the ring step) and no soft
cap: `cudnn_kernel` raises ValueError for a window or a cap, and its kernel says
`segments=False`, so `flash_context_attention` raises ValueError for segment ids. Tracing asks the cuDNN library for its version, so a compile for GPU
targets needs NVIDIA's cuDNN wheel beside the plugin (`python -m fsdp_jax.targets install`).
"""

from __future__ import annotations

import jax.numpy as jnp

from fsdp_jax.sharding.ring_kernels import BlockKernel


def _fa():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    return fa


def cudnn_kernel(*, scale: float, softcap: float = 0.0, window: int = 0) -> BlockKernel:
    """The cuDNN `BlockKernel` (module docstring); ValueError for a window or a soft cap."""
    for name, value in (("sliding window", window), ("soft cap", softcap)):
        if value:
            raise ValueError(f"cuDNN per ring block takes no {name} ({value}); use model.attention=xla")

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
        )
        dq, dk, dv = grads[:3]
        return dq.astype(jnp.float32), dk.astype(jnp.float32), dv.astype(jnp.float32)

    return BlockKernel(fwd, bwd, segments=False)
