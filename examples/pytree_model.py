"""FSDP for a plain-pytree model (no Flax, no annotations) on 8 CPU devices.

    python examples/pytree_model.py [--steps 20]

The params are NamedTuples of arrays, as an Equinox model filtered to its arrays
would be. With no logical names, the fallback rule shards each leaf of at least
`min_shard_size` elements on its largest dim divisible by the shard group and
replicates small leaves (biases); `explain()` prints which rule applied.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # CPU only: 8 fake devices (drop on GPU)

import argparse  # noqa: E402
from typing import NamedTuple  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402

import fsdp_jax as fj  # noqa: E402
from fsdp_jax.train.shard_model import shard_model  # noqa: E402

D_IN, D_HIDDEN, N_CLASSES, N_LAYERS = 64, 512, 32, 2


class Dense(NamedTuple):
    w: jax.Array  # (in, out)
    b: jax.Array  # (out,)


class Classifier(NamedTuple):
    hidden: tuple[Dense, ...]
    readout: Dense


def dense(rng, n_in: int, n_out: int, scale: float = 1.0) -> Dense:
    return Dense(scale * jax.random.normal(rng, (n_in, n_out)) / n_in**0.5, jnp.zeros((n_out,)))


def init(rng) -> Classifier:
    """Called under jit with the plan's out_shardings: each shard is created where it lives."""
    ks = jax.random.split(rng, N_LAYERS + 1)
    dims = [D_IN] + [D_HIDDEN] * N_LAYERS
    hidden = tuple(dense(k, a, b) for k, a, b in zip(ks, dims[:-1], dims[1:]))
    return Classifier(hidden, dense(ks[-1], D_HIDDEN, N_CLASSES, scale=0.1))


def apply(params: Classifier, x):  # (B, D_IN) -> logits (B, N_CLASSES)
    for layer in params.hidden:
        x = jax.nn.relu(x @ layer.w + layer.b)
    return x @ params.readout.w + params.readout.b


def loss_fn(params: Classifier, batch):
    x, labels = batch
    return optax.softmax_cross_entropy_with_integer_labels(apply(params, x), labels).mean()


def make_batches(n: int, batch: int = 32, seed: int = 1):
    """`n` batches cycling over a 128-example training set labelled by a fixed random
    linear teacher: argmax(x @ A)."""
    a = jax.random.normal(jax.random.key(seed), (D_IN, N_CLASSES))
    x = jax.random.normal(jax.random.key(seed + 1), (128, D_IN))
    y = jnp.argmax(x @ a, axis=-1)
    starts = [(i * batch) % 128 for i in range(n)]
    return [(x[s : s + batch], y[s : s + batch]) for s in starts]


def main(steps: int = 20):
    mesh = fj.make_mesh(fsdp=-1)  # (data=1, fsdp=8, tensor=1)
    opt = optax.adam(3e-3)
    sm = shard_model(init, opt, mesh, "full_shard", rng=jax.random.key(0))
    print(sm.explain())
    step = sm.train_step(loss_fn)
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
