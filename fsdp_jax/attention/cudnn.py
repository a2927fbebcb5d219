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
q and kv segments (`fsdp_jax.attention.cudnn_packed.block_layout`, computed from the q side's
and the travelling K/V block's segment ids), PADDING_CAUSAL for the own block and PADDING for
the half blocks; queries that meet no key of the block get o 0 and lse -inf, keys that meet no
query no gradient. Both calls bind jax's private primitives directly (`_dot_product_attention_
fwd_p_wrapper` / `_bwd_p_wrapper`): the public function's check for a packed layout asks the
local device for Hopper, which a deviceless compile has not (the kernel is for sm_90+). With
the packed layout jax 0.10 scales BOTH sides' offsets by q's heads x head dim (`_fix_seqlen_offsets`;
jax 0.12 scales K/V's by their own heads), so grouped-query K/V are repeated to q's heads for
those calls and their gradients summed back (right on both; on 0.12 the repeat is not needed).
A block with more than `max_segments` segments gives NaN for its row (a loud failure) rather
than dropping segments; the trainer sizes it from `model.max_segments` and refuses a batch row
with more segments in one line, so it does not happen there.

Sliding windows (`window`): the ring gives the kernel chunk pairs with a static `Band` each
(`fsdp_jax.attention.windows`), which `fsdp_jax.attention.cudnn_bands.band_pieces` covers with
CAUSAL, NO_MASK and CAUSAL + sliding-window calls, some on both sides reversed; with packed rows
each piece goes in the packed layout (module docstring of `cudnn_bands`, `packed_kernel`).

cuDNN's flash kernels take bfloat16 / float16 q, k, v only. No soft cap: `cudnn_kernel` raises
ValueError; without `packed` its kernel says `segments=False`, so `flash_context_attention`
raises ValueError for segment ids. Tracing the unpacked forward asks the cuDNN library for its
version, so a compile for GPU targets needs NVIDIA's cuDNN wheel beside the plugin
(`python -m fsdp_jax.targets install`).
"""

from __future__ import annotations

import inspect

import jax.numpy as jnp

from fsdp_jax.attention.cudnn_bands import by_pieces, piece_window
from fsdp_jax.attention.cudnn_packed import block_layout, packed_stats, span_layout, token_lse
from fsdp_jax.attention.kernels import BlockKernel, merge

# segments per block cuDNN's packed layout is sized for (stats (B x M, H, Sq) float32 per call)
MAX_SEGMENTS = 128


def _fa():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    return fa


def _version_params() -> dict:
    """The primitives' params that only some jax versions take: jax 0.12 adds flex attention's
    `score_mod` (its `score_mod_args` operands spread after the others: none here), jax 0.10
    has neither (tests/test_ring_cudnn.py pins both)."""

    takes = "score_mod" in inspect.signature(_fa()._dot_product_attention_bwd_impl).parameters
    return {"score_mod": None} if takes else {}


def cudnn_kernel(
    *,
    scale: float,
    softcap: float = 0.0,
    window: int = 0,
    packed: bool = False,
    max_segments: int = MAX_SEGMENTS,
    backend=None,
) -> BlockKernel:
    """The cuDNN `BlockKernel` (module docstring); ValueError for a soft cap. `packed`: the
    blocks take segment ids (cuDNN's packed layout per block); `window`: the ring gives the
    kernel chunk pairs and their bands (`ring_window`); `backend` = (fwd, bwd) with
    `_plain_fwd` / `_plain_bwd`'s signatures (`_cudnn_fwd` / `_cudnn_bwd`'s with `packed`)
    replaces cuDNN (the CPU tests' emulation)."""
    if softcap:
        raise ValueError(f"cuDNN per ring block takes no soft cap ({softcap}); use model.attention=xla")
    if packed:
        return packed_kernel(scale=scale, max_segments=max_segments, window=window, backend=backend)
    call_fwd, call_bwd = backend or (_plain_fwd, _plain_bwd)

    def piece_fwd(q, k, v, qs, ks, kind):
        o, lse = call_fwd(q, k, v, kind != "full", piece_window(kind), scale=scale)
        return o.astype(jnp.float32), lse.astype(jnp.float32)

    def piece_bwd(q, k, v, qs, ks, kind, o, lse, do):
        grads = call_bwd(q, k, v, o, lse, do, kind != "full", piece_window(kind), scale=scale)
        return tuple(g.astype(jnp.float32) for g in grads)

    return BlockKernel(*by_pieces(piece_fwd, piece_bwd), segments=False, window=window)


def _plain_fwd(q, k, v, causal, window, *, scale):
    """cuDNN's forward on an unpacked block: (o (B, Sq, H, Dh), lse (B, Sq, H) float32)."""
    fa = _fa()
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    o, lse = fa.dot_product_attention(
        q, k, v, scale=scale, mask_type=mask, qkv_layout="BTNH", sliding_window_length=window, return_residual=True
    )
    return o, jnp.swapaxes(lse, 1, 2).astype(jnp.float32)


def _plain_bwd(q, k, v, o, lse, do, causal, window, *, scale):
    """cuDNN's backward on an unpacked block given the ring's global o and lse: (dq, dk, dv)."""
    fa = _fa()
    unused = jnp.zeros(0, dtype=q.dtype)
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v,
        unused, unused, unused, unused, unused, unused, unused,  # bias, seqlens, offsets, page tables
        jnp.swapaxes(lse, 1, 2).astype(jnp.float32),  # activation: the global lse (B, H, Sq)
        o.astype(q.dtype),  # fwd_output: the global o
        do.astype(q.dtype),  # grad_output
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False),  # (has_bias, has_dbias)
        mask_type=fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK, layout=fa.AttentionLayout.BTNH.value,
        sliding_window_length=window, **_version_params(),
    )  # fmt: skip
    return grads[:3]


def _cudnn_fwd(q, k, v, lay, causal, *, scale, window=None):
    """cuDNN's forward on one block in its packed layout: (o (B, Sq, H, Dh), stats (B x M, H, Sq))."""
    fa = _fa()
    unused = jnp.zeros(0, dtype=q.dtype)
    o, stats = fa._dot_product_attention_fwd_p_wrapper.bind(
        q, k, v, unused, lay.q_seqlen, lay.kv_seqlen, lay.q_offsets, lay.kv_offsets, unused, unused,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=_packed_mask(causal),
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=window, is_training=True, **_version_params(),
    )  # fmt: skip
    return o, stats


def _cudnn_bwd(q, k, v, lay, causal, stats, o, do, *, scale, window=None):
    """cuDNN's backward on one block in its packed layout, given packed stats: (dq, dk, dv)."""
    fa = _fa()
    unused = jnp.zeros(0, dtype=q.dtype)
    grads = fa._dot_product_attention_bwd_p_wrapper.bind(
        q, k, v, unused, lay.q_seqlen, lay.kv_seqlen, lay.q_offsets, lay.kv_offsets, unused, unused,
        stats, o, do,
        scale=scale, seed=42, dropout_rate=0.0, variadic_args=(False, False), mask_type=_packed_mask(causal),
        layout=fa.AttentionLayout.BTNH.value, sliding_window_length=window, **_version_params(),
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


def packed_kernel(*, scale: float, max_segments: int = MAX_SEGMENTS, window: int = 0, backend=None) -> BlockKernel:
    """The cuDNN `BlockKernel` for packed rows (module docstring). `backend` = (fwd, bwd) with
    `_cudnn_fwd` / `_cudnn_bwd`'s signatures replaces cuDNN (the CPU tests' emulation)."""
    call_fwd, call_bwd = backend or (_cudnn_fwd, _cudnn_bwd)

    def calls(qs, ks, kind):
        """[(layout, causal, window)] of a piece, and its queries that may see a key (None: all)."""
        if kind != "anti":
            return [(block_layout(qs, ks, max_segments=max_segments), kind != "full", piece_window(kind))], None
        # a reversed square whose keys all preceded its queries: only the segment across the gap
        # is on both sides, now a q suffix (qn rows) and a kv prefix (kn rows); y <= x within it
        # is cuDNN's per-segment causal mask only with equal starts, so: q rows [0, kn) against
        # kv [0, kn) causal, q rows [kn, L) against kv [0, kn) unmasked, then drop q rows < L - qn
        sq = qs.shape[1]
        common = ks[:, 0] == qs[:, -1]
        kn = jnp.where(common, jnp.sum(ks == ks[:, :1], axis=1), 0).astype(jnp.int32)
        qn = jnp.where(common, jnp.sum(qs == qs[:, -1:], axis=1), 0).astype(jnp.int32)
        zero = jnp.zeros_like(kn)
        valid = jnp.arange(sq)[None] >= (sq - qn)[:, None]
        spans = [
            (span_layout(zero, kn, zero, kn, sq, sq), True, None),
            (span_layout(kn, sq - kn, zero, kn, sq, sq), False, None),
        ]
        return spans, valid

    def piece_fwd(q, k, v, qs, ks, kind):
        h = q.shape[2]
        kr, vr = _heads(k, h), _heads(v, h)
        specs, valid = calls(qs, ks, kind)
        acc = None
        for lay, causal, win in specs:
            o, stats = call_fwd(q, kr, vr, lay, causal, scale=scale, window=win)
            o = jnp.where((lay.q_seg >= 0)[..., None, None], o.astype(jnp.float32), 0.0)
            o = jnp.where(lay.overflow[:, None, None, None], jnp.nan, o)
            part = (o, token_lse(stats, lay))
            acc = part if acc is None else merge(acc, part)
        if valid is None:
            return acc
        return jnp.where(valid[..., None, None], acc[0], 0.0), jnp.where(valid[..., None], acc[1], -jnp.inf)

    def piece_bwd(q, k, v, qs, ks, kind, o, lse, do):
        h, kvh = q.shape[2], k.shape[2]
        kr, vr = _heads(k, h), _heads(v, h)
        specs, valid = calls(qs, ks, kind)
        if valid is not None:  # dropped queries: no output gradient, and P = exp(S - 1e30) = 0
            do = jnp.where(valid[..., None, None], do, 0)
            lse = jnp.where(valid[..., None], lse, 1e30)
        dq = jnp.zeros(q.shape, jnp.float32)
        dk = jnp.zeros(k.shape, jnp.float32)
        dv = jnp.zeros(v.shape, jnp.float32)
        for lay, causal, win in specs:
            stats = packed_stats(lse, lay)  # the ring's global lse in cuDNN's packed layout
            gq, gk, gv = call_bwd(
                q, kr, vr, lay, causal, stats, o.astype(q.dtype), do.astype(q.dtype), scale=scale, window=win
            )
            dq = dq + jnp.where((lay.q_seg >= 0)[..., None, None], gq.astype(jnp.float32), 0.0)
            kv_seen = lay.kv_covered[..., None, None]
            dk = dk + jnp.where(kv_seen, _fold(gk.astype(jnp.float32), kvh), 0.0)
            dv = dv + jnp.where(kv_seen, _fold(gv.astype(jnp.float32), kvh), 0.0)
        return dq, dk, dv

    return BlockKernel(*by_pieces(piece_fwd, piece_bwd), window=window)
