"""Verify your own model before renting a cluster: `fsdp_jax.verify.run` on a small NNX
model, healthy or with a deliberate bug.

    python examples/verify_model.py                  # passes
    python examples/verify_model.py --bug psum       # psum where pmean was meant: fails
    python examples/verify_model.py --bug local_mean # a shard_map that forgets its pmean: fails

The model is an MLP classifier with an activity penalty on its head, averaged over the
batch inside a `shard_map` (as hand-written collectives often are). `--bug psum` sums
the per-device means instead of averaging them, so the penalty is N times too large on
N devices and exactly right on one: the kind of bug that only shows on a cluster.
`--bug local_mean` centres the hidden features with each device's own batch mean.
Runs on 8 CPU devices (set here, before JAX starts).
"""

import argparse
import sys

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from flax import nnx  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fsdp_jax as fj  # noqa: E402
from fsdp_jax.sharding import axes  # noqa: E402

D, H, C, BATCH = 64, 256, 16, 32
BATCH_AXES = (axes.DATA, axes.FSDP)


class MLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(nnx.with_partitioning(init, (axes.EMBED, axes.MLP))(rngs.params(), (D, H)))
        self.head = nnx.Param(nnx.with_partitioning(init, (axes.MLP, axes.EMBED))(rngs.params(), (H, C)))


def per_device(fn, out_specs):
    """`fn` on each device's rows of the batch (shard_map over the batch axes of the
    mesh the train step sets)."""
    return jax.shard_map(fn, in_specs=P(BATCH_AXES), out_specs=out_specs)


def make(bug: str = "none"):
    model = fj.from_nnx(MLP)

    def loss_fn(params, batch):
        m = model.bind(params)
        h = jnp.tanh(batch["x"] @ m.w1[...])  # (B, H)

        def center(hl):
            mean = hl.mean(0, keepdims=True)
            return hl - (mean if bug == "local_mean" else jax.lax.pmean(mean, BATCH_AXES))

        h = per_device(center, P(BATCH_AXES))(h)
        logits = h @ m.head[...]  # (B, C)
        xent = -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), batch["y"][:, None], -1))
        reduce = jax.lax.psum if bug == "psum" else jax.lax.pmean
        act = jax.lax.stop_gradient(h) @ m.head[...]
        penalty = per_device(lambda a: reduce(jnp.mean(a * a), BATCH_AXES), P())(act)
        return xent + 0.1 * penalty

    rng = np.random.default_rng(0)
    batches = [
        {"x": rng.normal(size=(BATCH, D)).astype(np.float32), "y": rng.integers(0, C, (BATCH,)).astype(np.int32)}
        for _ in range(3)
    ]
    return model, loss_fn, batches


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bug", choices=("none", "psum", "local_mean"), default="none")
    args = ap.parse_args()
    model, loss_fn, batches = make(args.bug)
    report = fj.verify(model, optax.adamw(1e-3), loss_fn, batches=batches, devices=8, steps=3, min_shard_size=1024)
    print(report.format())
    return 0 if report.passed else 1


if __name__ == "__main__":
    sys.exit(main())
