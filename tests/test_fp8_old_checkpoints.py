"""Delayed-FP8 checkpoints written before the backward-written histories existed
(`fp8_<w>_grad_amax_from_grad`, per-expert `fp8_<w>_amax_from_grad`): a restore creates
those leaves as zeros (a fresh history: the scale comes from the current amax), lists them
(`Restored.filled`; the trainer says so in one line on stderr) and continues exactly as from
a checkpoint whose histories are zero; any other missing leaf, or one of another shape, is
still refused in one line (docs/fp8.md). The tests write the old layout themselves."""

from __future__ import annotations

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_fp8 import batches, built, cfg_for

from fsdp_jax.checkpoint import Checkpointer, tree_paths
from fsdp_jax.checkpoint.manifest import write_manifest
from fsdp_jax.errors import CheckpointError
from fsdp_jax.quant.fp8_modules import fills_with_zeros
from helpers import TINY_RUN_OVERRIDES, call, one_line

GRAD = "grad_amax_from_grad"  # the 7 projections' output-gradient histories (one leaf each, stacked over layers)


def _edit(state, fn):
    """`state` with each model-state leaf replaced by fn(name, leaf) (None drops it)."""

    def leaf(path, x):
        name = jax.tree_util.keystr(path)
        return fn(name, x) if "model_state" in name else x

    return jax.tree_util.tree_map_with_path(leaf, state)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """2 delayed-recipe steps on one device, saved three ways: the old layout (no gradient
    histories), the new layout with zeroed gradient histories, and the old layout without
    `wq`'s input/weight history too."""
    b, data = built(cfg_for(history=4), "no_shard", 1), batches(4)
    state = b.init_state(jax.random.key(0))
    for batch in data[:2]:
        state, _ = b.train_step(state, batch)
    layouts = {
        "old": lambda n, x: None if GRAD in n else x,
        "zeros": lambda n, x: jnp.zeros_like(x) if GRAD in n else x,
        "old_no_wq": lambda n, x: None if GRAD in n or n.rstrip("']").endswith("fp8_wq_amax") else x,
        "old_reshaped": lambda n, x: jnp.zeros(x.shape[:-1] + (5,), x.dtype) if GRAD in n else x,
    }
    dirs = {}
    for name, fn in layouts.items():
        dirs[name] = tmp_path_factory.mktemp(name)
        with Checkpointer(dirs[name], async_save=False) as ckpt:
            ckpt.save(2, _edit(state, fn))
    return b, data, jax.device_get(state), dirs


@pytest.mark.slow
def test_old_delayed_checkpoint_restores_with_zero_gradient_histories_and_continues_exactly(saved):
    b, data, state, dirs = saved
    old = Checkpointer(dirs["old"], read_only=True).restore(b.abstract_state, fill_missing=fills_with_zeros)
    grads = sorted(p for p in tree_paths(b.abstract_state) if GRAD in p)
    assert len(grads) == 7 and old.filled == tuple(grads)
    got, want = tree_paths(jax.device_get(old.state)), tree_paths(state)
    for p in grads:
        assert got[p].shape == want[p].shape and not np.asarray(got[p]).any() and np.asarray(want[p]).any()
    for p in set(want) - set(grads):  # everything saved comes back bit for bit
        np.testing.assert_array_equal(np.asarray(got[p]), np.asarray(want[p]), err_msg=p)
    zeros = Checkpointer(dirs["zeros"], read_only=True).restore(b.abstract_state, fill_missing=fills_with_zeros)
    assert zeros.filled == ()
    a, z = old.state, zeros.state
    for batch in data[2:]:
        a, ma = b.train_step(a, batch)
        z, mz = b.train_step(z, batch)
        assert float(ma["loss"]) == float(mz["loss"])
    for p, x in tree_paths(jax.device_get(a)).items():
        np.testing.assert_array_equal(np.asarray(x), np.asarray(tree_paths(jax.device_get(z))[p]), err_msg=p)
    hist = [np.asarray(x) for p, x in tree_paths(jax.device_get(a)).items() if GRAD in p]
    assert all(h[..., :2].all() and not h[..., 2:].any() for h in hist)  # the 2 new steps pushed theirs


@pytest.mark.parametrize(
    "layout,fill,words",
    [
        ("old", False, f"fp8_wq_{GRAD}: not in the checkpoint"),  # no fill asked: named as before
        ("old_no_wq", True, "fp8_wq_amax: not in the checkpoint"),  # an input/weight history is not filled
        ("old_reshaped", True, f"fp8_wq_{GRAD}: checkpoint (2, 5) vs model (2, 4)"),
    ],
)
@pytest.mark.slow
def test_other_missing_or_reshaped_leaves_are_still_refused(saved, layout, fill, words):
    b, _, _, dirs = saved
    with pytest.raises(CheckpointError) as e:
        Checkpointer(dirs[layout], read_only=True).restore(
            b.abstract_state, fill_missing=fills_with_zeros if fill else None
        )
    assert words in str(e.value) and "\n" not in str(e.value)


def test_only_backward_written_fp8_histories_are_fillable():
    assert fills_with_zeros("model_state/blocks/attn/fp8_wq_grad_amax_from_grad")
    assert fills_with_zeros("model_state/blocks/moe/fp8_w_gate_amax_from_grad")  # per-expert (E, 3, L)
    assert not fills_with_zeros("model_state/blocks/attn/fp8_wq_amax")
    assert not fills_with_zeros("params/blocks/attn/fp8_wq_grad_amax_from_grad")
    assert not fills_with_zeros("model_state/blocks/bn/mean_from_grad")


def _to_old_layout(step_dir, drop):
    """Rewrite a trainer checkpoint step as an older version wrote it: the shard index
    without the leaves `drop` accepts, their files gone, the manifest written again."""
    for index in (step_dir / "state").glob("shards.*.json"):
        doc = json.loads(index.read_text())
        for name in [n for n in doc["leaves"] if drop(n)]:
            for f in doc["leaves"].pop(name)["files"]:
                (step_dir / "state" / f["file"]).unlink()
        index.write_text(json.dumps(doc))
    write_manifest(step_dir, int(step_dir.name))


@pytest.mark.slow
def test_trainer_resumes_an_old_delayed_checkpoint_saying_so_on_stderr(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = [
        "--config",
        "configs/tiny.yaml",
        "--no-progress",
        *TINY_RUN_OVERRIDES,
        f"data.path={corpus}",
        f"run_dir={run_dir}",
        "precision=params=float32,compute=bfloat16,matmul=fp8",
        "fp8.emulate=true",
        "fp8.recipe=delayed",
        "fp8.amax_history=4",
        "train.checkpoint_every=1",
    ]
    rc, _, err = call("train", *args, "train.steps=1", capsys=capsys)
    assert rc == 0, err
    _to_old_layout(run_dir / "checkpoints" / "1", lambda n: GRAD in n)
    rc, out, err = call("train", *args, "train.steps=2", capsys=capsys)
    assert rc == 0, err
    line = [x for x in err.splitlines() if "start as zeros" in x]
    assert len(line) == 1 and "7 leaves" in line[0] and f"fp8_wq_{GRAD}" in line[0], err
    assert "resuming from checkpoint step 1" in out
    _to_old_layout(run_dir / "checkpoints" / "2", lambda n: GRAD in n or n.endswith("fp8_wq_amax"))
    rc, _, err = call("train", *args, "train.steps=3", capsys=capsys)
    one_line(rc, err, "fp8_wq_amax: not in the checkpoint", "checkpoints/2")  # refused, not step 1 instead
