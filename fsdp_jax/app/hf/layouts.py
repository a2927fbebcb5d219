"""One layer's tensor in our layout and in Hugging Face's: `read_block` reads ours (sliced)
from an HF tensor, `to_hf` writes it back. A kind names the conversion: `id`, `t` (transposed),
`qkv` (HF (N*Dh, D) -> ours (D, N, Dh)), `bias` ((N*Dh,) -> (N, Dh)), `o` (HF (D, H*Dh) -> ours
(H, Dh, D)), an MXFP4 kind read as stored, and an expert kind (`moe_layout.EXPERT_KIND` + kind)."""

from __future__ import annotations

import numpy as np

from fsdp_jax.app.hf import moe_layout, mxfp4
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile


def span(s: slice, n: int) -> tuple[int, int]:
    a, b, _ = s.indices(n)
    return a, b


def read_block(
    f: SafetensorsFile, name: str, kind: str, idx: tuple[slice, ...], shape: tuple[int, ...], dh: int, dtype
) -> np.ndarray:
    """Our per-layer tensor of `shape`, sliced by `idx`, read from HF tensor `name` (the
    per-head width of a `qkv` / `bias` / `o` leaf is its own: (.., N, Dh) / (H, Dh, D))."""
    dh = shape[1] if kind == "o" else shape[-1]
    if kind in ("id", mxfp4.KIND):
        return f.read(name, *idx, dtype=dtype)
    if kind == "t":  # ours (a, b) = w.T
        return f.read(name, idx[1], idx[0], dtype=dtype).T
    if kind == "qkv":  # ours (D, N, Dh) = w.T.reshape(D, N, Dh), w (N*Dh, D)
        n0, n1 = span(idx[1], shape[1])
        w = f.read(name, slice(n0 * dh, n1 * dh), idx[0], dtype=dtype)  # (n*Dh, d)
        return w.reshape(n1 - n0, dh, -1)[:, idx[2], :].transpose(2, 0, 1)
    if kind == "bias":  # ours (N, Dh) = b.reshape(N, Dh), b (N*Dh,)
        n0, n1 = span(idx[0], shape[0])
        return f.read(name, slice(n0 * dh, n1 * dh), dtype=dtype).reshape(n1 - n0, dh)[:, idx[1]]
    if kind == "o":  # ours (H, Dh, D) = w.T.reshape(H, Dh, D), w (D, H*Dh)
        h0, h1 = span(idx[0], shape[0])
        w = f.read(name, idx[2], slice(h0 * dh, h1 * dh), dtype=dtype)  # (d, h*Dh)
        return w.reshape(-1, h1 - h0, dh)[:, :, idx[1]].transpose(1, 2, 0)
    raise ValueError(kind)


def to_hf(kind: str, ours: np.ndarray, expert: int | None = None) -> np.ndarray:
    """One layer's tensor in HF layout (the inverse of `read_block` on the whole tensor);
    an expert kind: expert `expert`'s."""
    if kind.startswith(moe_layout.EXPERT_KIND):
        return to_hf(kind[len(moe_layout.EXPERT_KIND) :], ours[expert])
    if kind in ("id", mxfp4.KIND):
        return ours
    if kind == "t":
        return ours.T
    if kind == "qkv":
        return ours.reshape(ours.shape[0], -1).T
    if kind == "bias":
        return ours.reshape(-1)
    if kind == "o":
        return ours.reshape(-1, ours.shape[-1]).T
    raise ValueError(kind)
