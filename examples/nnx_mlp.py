"""FSDP for a Flax NNX model: a residual MLP regressor on 8 CPU devices.

    python examples/nnx_mlp.py [--steps 20]

The model names its parameter dims with logical names (`embed`, `mlp`); the rules
table shards `embed` over the `fsdp` mesh axis. Nothing here mentions a device.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # CPU only: 8 fake devices (drop on GPU)

import argparse  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402

import fsdp_jax as fj  # noqa: E402
from fsdp_jax.model.fns import from_nnx  # noqa: E402
from fsdp_jax.train.shard_model import shard_model  # noqa: E402

D_MODEL, D_HIDDEN, N_BLOCKS = 64, 256, 2


def dense(n_in: int, n_out: int, names, rngs: nnx.Rngs) -> nnx.Linear:
    """nnx.Linear whose kernel dims are named `names` (its bias takes the output name)."""
    return nnx.Linear(
        n_in,
        n_out,
        rngs=rngs,
        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
        bias_init=nnx.with_partitioning(nnx.initializers.zeros, names[1:]),
    )


class MLPBlock(nnx.Module):
    """Residual MLP block: x + W_down gelu(W_up x)."""

    def __init__(self, d: int, hidden: int, *, rngs: nnx.Rngs):
        self.up = dense(d, hidden, ("embed", "mlp"), rngs)
        self.down = dense(hidden, d, ("mlp", "embed"), rngs)

    def __call__(self, x):  # (B, D) -> (B, D)
        return x + self.down(jax.nn.gelu(self.up(x)))


class MLP(nnx.Module):
    """x (B, D) -> y (B, D): N residual MLP blocks and a linear readout."""

    def __init__(self, d: int = D_MODEL, hidden: int = D_HIDDEN, n_blocks: int = N_BLOCKS, *, rngs: nnx.Rngs):
        self.blocks = nnx.List([MLPBlock(d, hidden, rngs=rngs) for _ in range(n_blocks)])
        self.readout = dense(d, d, ("embed", None), rngs)

    def __call__(self, x):
        for blk in self.blocks:
            x = blk(x)
        return self.readout(x)


def make_model():
    """Adapted for fsdp_jax: init(rng) builds the module under jit, sharded."""
    return from_nnx(lambda rngs: MLP(rngs=rngs))


def make_batches(n: int, batch: int = 32, seed: int = 1):
    """Regression targets from a fixed random teacher: y = sin(x @ A)."""
    a = jax.random.normal(jax.random.key(seed), (D_MODEL, D_MODEL)) / D_MODEL**0.5
    xs = [jax.random.normal(jax.random.key(seed + 1 + i), (batch, D_MODEL)) for i in range(n)]
    return [(x, jnp.sin(x @ a)) for x in xs]


def make_loss_fn(model):
    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((model.apply(params, x) - y) ** 2)

    return loss_fn


def main(steps: int = 20):
    model = make_model()
    mesh = fj.make_mesh(fsdp=-1)  # (data=1, fsdp=8, tensor=1)
    opt = optax.adam(3e-3)
    sm = shard_model(model, opt, mesh, "full_shard", rng=jax.random.key(0))
    print(sm.explain())
    step = sm.train_step(make_loss_fn(model))
    state = sm.state
    for i, batch in enumerate(make_batches(steps)):
        state, metrics = step(state, batch)
        print(f"step {i} loss {float(metrics['loss']):.6f}")  # blocks: bounds steps in flight on CPU
    b = sm.bytes_per_device(state)
    print(f"per-device bytes: params {b['params']} opt_state {b['opt_state']} total {b['total']}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20)
    main(p.parse_args().steps)
