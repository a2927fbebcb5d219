"""Long-context RoPE (llama3 and yarn scaling) at sequences 4x past the original context:
the inverse frequencies against Meta's `apply_scaling` written out here, the tables at
positions past the original context, and scores that depend only on the distance between
query and key (so the zig-zag layout's permuted positions change nothing)."""

import dataclasses
import math

import jax.numpy as jnp
import numpy as np
import pytest

from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.rope import apply_rope, inv_freq, rope_tables

ORIG = 64
BASE = DecoderConfig(d_model=256, n_heads=2, n_kv_heads=2, max_seq_len=4 * ORIG, rope_theta=10000.0)
LLAMA3 = dataclasses.replace(BASE, rope_type="llama3", rope_factor=8.0, rope_original_max_len=ORIG)
YARN = dataclasses.replace(BASE, rope_type="yarn", rope_factor=4.0, rope_original_max_len=ORIG)


def meta_apply_scaling(freqs, scale_factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's llama3 `apply_scaling` (llama-models, reference implementation), in float64."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / scale_factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / scale_factor + smooth * freq)
    return np.asarray(out)


def test_llama3_frequencies_and_tables_past_the_original_context():
    dh = BASE.head_dim
    base = 1.0 / 10000.0 ** (np.arange(0, dh, 2) / dh)
    want = meta_apply_scaling(base, 8.0, 1.0, 4.0, ORIG)
    got, scale = inv_freq(LLAMA3)
    assert scale == 1.0
    np.testing.assert_allclose(got, want, rtol=2e-6)
    assert (got < base).any() and (got == base.astype(np.float32)).any()  # both regimes are hit
    cos, sin = rope_tables(LLAMA3, 4 * ORIG)
    pos = np.arange(4 * ORIG)[:, None]
    np.testing.assert_allclose(np.asarray(cos), np.cos(pos * want), atol=2e-4)
    np.testing.assert_allclose(np.asarray(sin), np.sin(pos * want), atol=2e-4)


@pytest.mark.parametrize("cfg", [LLAMA3, YARN], ids=["llama3", "yarn"])
def test_scores_depend_only_on_distance_past_the_original_context(cfg):
    rng = np.random.default_rng(0)
    s, dh = 4 * ORIG, cfg.head_dim
    q = jnp.asarray(rng.normal(size=(1, 1, 1, dh)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(1, 1, 1, dh)), jnp.float32)
    cos, sin = rope_tables(cfg, s)

    def score(pq, pk):
        rq = apply_rope(q, cos[pq][None, None], sin[pq][None, None])
        rk = apply_rope(k, cos[pk][None, None], sin[pk][None, None])
        return float(jnp.sum(rq * rk))

    for d in (0, 5, ORIG - 1, ORIG + 7, 3 * ORIG):
        near = score(d, 0)
        for shift in {x for x in (ORIG, 2 * ORIG, s - 1 - d) if d + x < s}:  # both past the original context
            assert score(d + shift, shift) == pytest.approx(near, rel=1e-3, abs=1e-3), (d, shift)
    if cfg.rope_type == "yarn":  # the attention factor scales cos and sin
        _, factor = inv_freq(cfg)
        assert factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
        assert float(jnp.max(jnp.abs(cos))) == pytest.approx(factor, rel=1e-5)
