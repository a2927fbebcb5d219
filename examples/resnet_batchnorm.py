"""FSDP for Flax's own ImageNet ResNet (Linen, BatchNorm) on 8 CPU devices.

    python examples/resnet_batchnorm.py [--steps 20] [--ckpt-dir DIR]

The model is `examples/imagenet/models.py` from the Flax repository, unchanged (a copy
lives in tests/third_party/flax_resnet.py; in your project, import your own). Its
BatchNorm statistics (the `batch_stats` collection) travel in `TrainState.model_state`:
sharded like params, updated by every step, checkpointed. Its BatchNorm names the
pmap axis `batch`; under GSPMD the statistics are already over the global batch, so
`from_linen(..., axis_names=("batch",))` binds that name to a size-1 axis.

With `--ckpt-dir` the run saves every step and resumes from the newest checkpoint:
kill it and start it again, and it continues exactly where it stopped.
"""

import jax

jax.config.update("jax_num_cpu_devices", 8)  # CPU only: 8 fake devices (drop on GPU)

import argparse  # noqa: E402
import pathlib  # noqa: E402
import sys  # noqa: E402

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402

import fsdp_jax as fj  # noqa: E402
from fsdp_jax.model.fns import from_linen  # noqa: E402
from fsdp_jax.train.shard_model import shard_model  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "tests"))
from third_party.flax_resnet import ResNet, ResNetBlock  # noqa: E402

IMAGE, CLASSES, BATCH = 16, 4, 32


def make_model():
    """A two-stage ResNet (8 and 16 filters) on 16x16 RGB images."""
    net = ResNet(stage_sizes=[1, 1], block_cls=ResNetBlock, num_classes=CLASSES, num_filters=8)
    return from_linen(net, jax.ShapeDtypeStruct((BATCH, IMAGE, IMAGE, 3), jnp.float32), axis_names=("batch",))


def make_loss_fn(model):
    """The extended loss (fsdp_jax.model.variables): gets the BatchNorm statistics as
    `state`, returns the updated ones; `train=False` in eval uses the running averages."""

    def loss_fn(params, batch, *, state, rng, train):
        logits, state = model.apply(params, batch["image"], state=state, rng=rng, train=train)
        loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
        return loss, state

    return loss_fn


def make_batches(n: int, seed: int = 0):
    """Learnable images: noise plus a bright patch in the quadrant named by the label."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        label = rng.integers(0, CLASSES, BATCH)
        img = rng.normal(0, 1, (BATCH, IMAGE, IMAGE, 3)).astype(np.float32)
        h = IMAGE // 2
        for i, c in enumerate(label):
            r, col = divmod(int(c), 2)
            img[i, r * h : (r + 1) * h, col * h : (col + 1) * h] += 2.0
        out.append({"image": jnp.asarray(img), "label": jnp.asarray(label, jnp.int32)})
    return out


def main(steps: int = 20, ckpt_dir: str | None = None, strategy: str = "full_shard"):
    model = make_model()
    mesh = fj.make_mesh(fsdp=8)
    sm = shard_model(
        model,
        optax.sgd(0.05, momentum=0.9),
        mesh,
        strategy,
        rng=jax.random.key(0),
        min_shard_size=256,
        max_replicated_fraction=None,
    )
    print(sm.explain())
    b = sm.bytes_per_device()
    print(
        f"per-device bytes: params {b['params']} opt_state {b['opt_state']} "
        f"model_state {b['model_state']} total {b['total']}"
    )
    loss_fn = make_loss_fn(model)
    step, evaluate = sm.train_step(loss_fn), sm.eval_step(loss_fn)
    batches = make_batches(steps)
    state, ckpt = sm.state, None
    if ckpt_dir:
        from fsdp_jax.checkpoint import Checkpointer

        ckpt = Checkpointer(ckpt_dir, keep=2, async_save=False)
        if ckpt.latest_step() is not None:  # resume: the same call, the state's own layout as target
            target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
            state = ckpt.restore(target).state
            print(f"resumed at step {int(state.step)}")
    for i in range(int(state.step), steps):
        state, metrics = step(state, batches[i])
        print(f"step {i + 1} loss {float(metrics['loss']):.6f}", flush=True)
        if ckpt is not None:
            ckpt.save(i + 1, state)
    if ckpt is not None:
        ckpt.close()
    val = make_batches(1, seed=1)[0]
    print(f"eval loss {float(evaluate(state.params, state.model_state, val)['loss']):.6f}")
    return state


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--ckpt-dir")
    ap.add_argument("--strategy", default="full_shard")
    a = ap.parse_args()
    main(a.steps, a.ckpt_dir, a.strategy)
