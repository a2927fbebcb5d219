"""Rotary position embeddings of the reference decoder: `default`, `linear`, `llama3`, `yarn`.

    cos, sin = rope_tables(cfg, seq_len)          # (S, Dh/2) float32 each, global layers
    cos, sin = rope_tables(cfg, seq_len, local=True)  # sliding layers (their own base)
    q = apply_rope(q, cos, sin)                   # (B, S, H, Dh), rotate-half

Inverse frequencies follow transformers' `modeling_rope_utils` (5.x) formula by
formula, computed once per trace in float32 numpy as torch computes them:
- default: 1 / base^(2i/Dh)  (the original in-graph formula, kept bit for bit);
- linear:  default / factor;
- llama3:  wavelengths over original_max / low_freq_factor divided by factor, under
  original_max / high_freq_factor kept, smoothly interpolated between;
- yarn:    interpolation (default / factor) and extrapolation (default) blended by a
  linear ramp over the dims whose rotations at the original context fall between
  beta_slow and beta_fast (the bounds floored/ceiled when `truncate`), and cos/sin
  multiplied by the attention factor (given, else 0.1 ln(factor) + 1, or the
  mscale / mscale_all_dim ratio).
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np

from fsdp_jax.app.models.choices import ROPE_TYPES


def _base_inv_freq(theta: float, dh: int) -> np.ndarray:
    return (1.0 / (np.float32(theta) ** (np.arange(0, dh, 2, dtype=np.float32) / np.float32(dh)))).astype(np.float32)


def yarn_attention_factor(cfg) -> float:
    f = cfg.rope_factor
    if cfg.rope_attention_factor:
        return cfg.rope_attention_factor

    def mscale(scale, m=1.0):
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if cfg.rope_mscale and cfg.rope_mscale_all_dim:
        return float(mscale(f, cfg.rope_mscale) / mscale(f, cfg.rope_mscale_all_dim))
    return mscale(f)


def inv_freq(cfg, local: bool = False) -> tuple[np.ndarray, float]:
    """(inverse frequencies (Dh/2,) float32, cos/sin scaling) of global or local layers."""
    dh = cfg.head_dim
    if local:  # sliding layers of a pattern: plain RoPE on their own base
        return _base_inv_freq(cfg.rope_local_theta or cfg.rope_theta, dh), 1.0
    base = _base_inv_freq(cfg.rope_theta, dh)
    kind, factor = cfg.rope_type, np.float32(cfg.rope_factor)
    if kind == "default":
        return base, 1.0
    if kind == "linear":
        return (base / factor).astype(np.float32), 1.0
    old = cfg.rope_original_max_len
    if kind == "llama3":
        lo, hi = cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
        wavelen = (2 * math.pi / base).astype(np.float32)
        out = np.where(wavelen > old / lo, base / factor, base).astype(np.float32)
        smooth = ((old / wavelen - lo) / (hi - lo)).astype(np.float32)
        smoothed = ((1 - smooth) * out / factor + smooth * out).astype(np.float32)
        medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
        return np.where(medium, smoothed, out).astype(np.float32), 1.0
    if kind == "yarn":

        def corr(rot):
            return (dh * math.log(old / (rot * 2 * math.pi))) / (2 * math.log(cfg.rope_theta))

        low, high = corr(cfg.rope_beta_fast), corr(cfg.rope_beta_slow)
        if cfg.rope_truncate:
            low, high = math.floor(low), math.ceil(high)
        low, high = max(low, 0), min(high, dh - 1)
        if low == high:
            high += 0.001
        ramp = np.clip((np.arange(dh // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1).astype(
            np.float32
        )
        extra = (1 - ramp).astype(np.float32)
        pos = np.float32(cfg.rope_theta) ** (np.arange(0, dh, 2, dtype=np.float32) / np.float32(dh))
        interp = (1.0 / (factor * pos)).astype(np.float32)
        out = interp * (1 - extra) + (1.0 / pos).astype(np.float32) * extra
        return out.astype(np.float32), yarn_attention_factor(cfg)
    raise ValueError(f"rope_type {kind!r}; allowed: {', '.join(ROPE_TYPES)}")


def rope_tables(cfg, seq_len: int, local: bool = False):
    """(cos, sin), each (S, Dh/2) float32, for positions 0..S-1."""
    pos = jnp.arange(seq_len).astype(jnp.float32)
    if cfg.rope_type == "default" and not local:  # the original formula, in-graph
        dh = cfg.head_dim
        freqs = cfg.rope_theta ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2 / dh)
        scale = 1.0
    else:
        f, scale = inv_freq(cfg, local)
        freqs = jnp.asarray(f)
    ang = pos[:, None] * freqs[None, :]
    cos, sin = jnp.cos(ang), jnp.sin(ang)
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos, sin


def apply_rope(x, cos, sin):
    """Rotate-half RoPE on (B, S, H, Dh) with (S, Dh/2) or per-row (B, S, Dh/2) tables, in float32."""
    c, s = cos[..., None, :], sin[..., None, :]
    if c.ndim == 3:
        c, s = c[None], s[None]
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * c - x2 * s, x1 * s + x2 * c], axis=-1).astype(x.dtype)
