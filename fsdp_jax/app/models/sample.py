"""Temperature sampling from the decoder, one token at a time over a fixed-size window."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np


def sample(next_logits, prompt, n_new: int, window: int, rng, temperature: float = 0.8) -> list[int]:
    """Temperature sampling of `n_new` tokens after `prompt` (1-D ints).

    `next_logits(buf (window,) int32, pos) -> logits (V,)` scores the token after
    position `pos - 1` of a fixed-size window (which slides once full), so one
    compiled forward serves every step."""
    toks = [int(t) for t in np.asarray(prompt)][-window:]
    out: list[int] = []
    for i in range(n_new):
        ctx = (toks + out)[-window:]
        buf = np.zeros((window,), np.int32)
        buf[: len(ctx)] = ctx
        logits = np.asarray(next_logits(buf, len(ctx)), np.float64) / max(temperature, 1e-6)
        key = jax.random.fold_in(rng, i)
        out.append(int(jax.random.categorical(key, jnp.asarray(logits))))
    return out
