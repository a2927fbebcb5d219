"""Attention kernels and context-parallel attention: what computes attention, not what
decides a sharding (that is `fsdp_jax.sharding`).

    ring          context-parallel causal attention over the `context` axis (ring or
                  all-gather of K/V; `context_attention`)
    flash         the ring with a flash kernel per block under one custom VJP
                  (`flash_context_attention`, `RING_KERNELS`)
    kernels       block kernels: bands, the pure-JAX reference, the log-sum-exp merge
    cudnn         cuDNN's fused flash attention per ring block (GPU)
    cudnn_bands   a block's static band as cuDNN mask calls
    cudnn_packed  cuDNN's packed (THD) layout of a block with segment ids
    splash_block  splash attention per ring block (TPU)
    splash        whole-sequence splash attention (TPU, `model.attention: splash`)
    windows       sliding windows in the flash ring (chunk pairs, static bands)

Model code calls the functions below; the modules are private to this package.
"""

from fsdp_jax.attention.flash import RING_KERNELS, flash_context_attention
from fsdp_jax.attention.ring import Q_CHUNK, context_attention
from fsdp_jax.attention.splash import splash_attention

__all__ = ["Q_CHUNK", "RING_KERNELS", "context_attention", "flash_context_attention", "splash_attention"]
