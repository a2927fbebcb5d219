"""The decoder's RMSNorm and its parameter initialiser (a weight named by logical dims, drawn
N(0, 0.02))."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from fsdp_jax.sharding.axes import NORM

NORMAL_INIT = nnx.initializers.normal(0.02)


def normal_param(rngs: nnx.Rngs, shape, names, init=NORMAL_INIT):
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape))


class RMSNorm(nnx.Module):
    """RMSNorm over the last dim in float32, scaled by w (or by 1 + w: `plus_one`, with w
    drawn N(0, 0.02) from `rngs`, not 0: a zero w's relative change over a step is
    rounding noise wherever its gradient is near 0, which verify.py's check reads as
    divergence)."""

    def __init__(self, dim: int, eps: float, plus_one: bool = False, rngs: nnx.Rngs | None = None):
        if plus_one:
            self.scale = normal_param(rngs, (dim,), (NORM,))
        else:
            self.scale = nnx.Param(nnx.with_partitioning(nnx.initializers.ones, (NORM,))(None, (dim,)))
        self.eps = eps
        self.plus_one = plus_one

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.eps)
        w = self.scale[...].astype(jnp.float32)
        return (y * (1.0 + w if self.plus_one else w)).astype(x.dtype)
