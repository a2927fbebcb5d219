"""LoRA adapters' dropout (`fsdp_jax.app.models.lora`): keys and masks from a key alone.

The key of layer `l` is `fold_in(key, l)` (`layer_keys`); each element of an adapter's input
rows is kept with probability 1 - p (`keep_mask`) and scaled by 1 / (1 - p) (`dropped`), so
the masks are the same on one device and on N, under every strategy.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def keep_mask(key, rate: float, shape) -> jax.Array:
    """Dropout's keep mask (bool, `shape`): each element kept with probability 1 - `rate`."""
    return jax.random.bernoulli(key, 1.0 - rate, shape)


def dropped(x, key, rate: float):
    """Inverted dropout of `x` (kept elements scaled by 1 / (1 - rate)); `x` itself without a
    key or at rate 0."""
    if key is None or not rate:
        return x
    keep = keep_mask(key, rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def layer_keys(key, n_layers: int):
    """The dropout keys of layers 0..n-1, `fold_in(key, l)` stacked (None without a key)."""
    if key is None:
        return None
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n_layers))
