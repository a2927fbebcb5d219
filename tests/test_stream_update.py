"""The streamed update of offloaded state (`fsdp_jax.train.stream_update`: the
`optimizer:streamed` and `optimizer+params:streamed` offloads): layer by layer, equal to no offload within the offload parity bound
(1e-6, tests/test_offload.py; NOT bit for bit: XLA:CPU rounds the loop body's fused
update differently in the last place, while the whole-leaf offload is bit-identical), its
host transfers inside the layer loop, and the whole-leaf fallback for an optimizer that
is not elementwise."""

import jax
import numpy as np
import optax
import pytest
from test_offload import STRATEGY_MESH, kinds, tiny_llama, token_batches

import fsdp_jax as fj
from fsdp_jax.sharding import offload as ol
from fsdp_jax.train import stream_update as su
from fsdp_jax.train.build import build


def run(offload, optimizer, strategy="full_shard", n=3, batch=8, **step_kw):
    m, loss_fn = tiny_llama()
    b = build(
        m, optimizer, fj.make_mesh(**STRATEGY_MESH[strategy]), strategy, loss_fn=loss_fn, offload=offload, **step_kw
    )
    state = b.init_state(jax.random.key(0))
    losses = []
    for x in token_batches(n, batch):
        state, mt = b.train_step(state, x)
        losses.append(float(mt["loss"]))
    return b, state, losses


def assert_matches(a, b, bound=1e-6):
    """Every leaf within `bound` (test_offload's parity bound) and not all of them equal
    bit for bit is allowed; losses are compared exactly by the callers."""
    for (path, x), y in zip(jax.tree_util.tree_flatten_with_path(a)[0], jax.tree.leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=0, atol=bound, err_msg=jax.tree_util.keystr(path))


def _while_bodies(jaxpr):
    for e in jaxpr.eqns:
        if e.primitive.name in ("while", "scan"):
            yield e.params.get("body_jaxpr", e.params.get("jaxpr")).jaxpr
        for v in e.params.values():
            sub = getattr(v, "jaxpr", None)
            if hasattr(sub, "eqns"):
                yield from _while_bodies(sub)


def _transfers(jaxpr) -> set[str]:
    """Memory kinds that device_puts directly in `jaxpr` move to."""
    out = set()
    for e in jaxpr.eqns:
        if e.primitive.name == "device_put":
            out |= {getattr(d, "memory_kind", None) for d in e.params["devices"]}
    return out


@pytest.mark.parametrize("opt", ["adamw", "sgd"])
def test_streamed_offload_matches_no_offload(opt):
    tx = {"adamw": lambda: optax.adamw(1e-3, weight_decay=0.1), "sgd": lambda: optax.sgd(0.5, momentum=0.9)}[opt]
    b, state, losses = run("optimizer+params:streamed", tx())
    assert (
        su.streams(b.plan)
        and su.elementwise_reason(b.optimizer, b.abstract_state.params, b.abstract_state.opt_state) is None
    )
    _, ref, ref_losses = run("none", tx())
    assert losses == ref_losses and losses[-1] < losses[0]
    assert_matches((ref.params, ref.opt_state), (state.params, state.opt_state))
    assert kinds(state.params) == kinds(state.opt_state) == {ol.HOST}


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGY_MESH))
def test_every_strategy_matches(strategy):
    _, ref, ref_losses = run("none", optax.adamw(1e-3), strategy)
    _, state, losses = run("optimizer:streamed", optax.adamw(1e-3), strategy)
    assert losses == ref_losses
    assert_matches((ref.params, ref.opt_state), (state.params, state.opt_state))


def test_microbatches_and_clipping_match():
    kw = dict(microbatches=2, clip_norm=0.05, batch=16)
    _, ref, ref_losses = run("none", optax.adamw(1e-3), **kw)
    _, state, losses = run("optimizer+params:streamed", optax.adamw(1e-3), **kw)
    assert losses == ref_losses
    assert_matches((ref.params, ref.opt_state), (state.params, state.opt_state))


def test_host_transfers_sit_inside_the_layer_loop():
    """The step's program: the loop over layers moves each layer's slice to the device and
    the new slice back to host memory (`device_put`s inside the loop body), and no
    device_put outside any loop brings a stacked leaf to the device whole."""
    b, state, _ = run("optimizer+params:streamed", optax.adamw(1e-3), n=1)
    x = token_batches(1)[0]
    from fsdp_jax.train.step import sharding_context

    with sharding_context(b.plan):
        jaxpr = b.train_step.jitted.trace(state, x).jaxpr.jaxpr
    step = jaxpr
    bodies = list(_while_bodies(step))
    assert any({"device", ol.HOST} <= _transfers(body) for body in bodies), "no host<->device transfers in a loop"
    # outside loops, the only stacked leaves fetched whole are the forward's params (their
    # compute copy; streaming those per layer is not done yet): no stacked optimizer state
    layers = b.abstract_state.params["blocks"]["mlp"]["w_up"].shape[0]
    whole = [
        e.invars[0].aval.shape
        for e in step.eqns
        if e.primitive.name == "device_put"
        and "device" in {getattr(d, "memory_kind", None) for d in e.params["devices"]}
        and e.invars[0].aval.ndim
        and e.invars[0].aval.size
        and e.invars[0].aval.shape[0] == layers
    ]
    stacked_params = [x.shape for x in jax.tree.leaves(b.abstract_state.params["blocks"])]
    assert sorted(whole) == sorted(stacked_params)


def test_not_elementwise_optimizer_falls_back_to_the_whole_leaf_update():
    tx = optax.chain(optax.clip_by_global_norm(1.0), optax.adamw(1e-3))
    m, loss_fn = tiny_llama()
    b = build(m, tx, fj.make_mesh(fsdp=8), "full_shard", loss_fn=loss_fn, offload="optimizer:streamed")
    reason = su.elementwise_reason(tx, b.abstract_state.params, b.abstract_state.opt_state)
    assert reason is not None and "reduce_sum" in reason
    adamw = optax.adamw(1e-3)
    params = b.abstract_state.params
    assert su.elementwise_reason(adamw, params, jax.eval_shape(adamw.init, params)) is None
    _, state, losses = run("optimizer:streamed", tx, n=2)
    _, ref, ref_losses = run("none", tx, n=2)
    assert losses == ref_losses


def test_per_layer_bytes_is_one_layer_of_the_offloaded_stacked_state():
    m, loss_fn = tiny_llama()
    tx = optax.adamw(1e-3)
    b = build(m, tx, fj.make_mesh(fsdp=8), "full_shard", loss_fn=loss_fn, offload="optimizer+params:streamed")
    blocks = b.abstract_state.params["blocks"]
    stacked = jax.tree.leaves(blocks)
    layers = stacked[0].shape[0]
    one = sum(int(np.prod(x.sharding.shard_shape(x.shape))) * 4 for x in stacked) // layers
    assert su.per_layer_bytes(tx, b.abstract_state, b.plan) == 3 * one  # params + mu + nu


TRAIN_OVERRIDES = [
    "model.d_model=32",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=64",
    "model.max_seq_len=16",
    "data.seq_len=16",
    "train.global_batch=8",
    "train.eval_every=0",
    "train.sample_tokens=0",
    "train.log_every=1",
    "train.checkpoint_every=2",
    "data.source=none",
]


def _losses(run_dir):
    import json

    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_trainer_streamed_offload_matches_no_offload_and_resumes_exactly(corpus, tmp_path):
    """The CPU trainer with offload=optimizer+params:streamed: its logged losses match the
    run without offload (test_offload's 1e-6), and resuming its step-2 checkpoint logs
    exactly the losses of the straight run and ends on its params bit for bit."""
    from pathlib import Path

    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.trainer.loop import train

    root = Path(__file__).resolve().parents[1]

    def go(offload, steps, name):
        over = TRAIN_OVERRIDES + [f"data.path={corpus}", f"run_dir={tmp_path / name}"]
        cfg = load_config(root / "configs" / "tiny.yaml", over + [f"offload={offload}", f"train.steps={steps}"])
        return train(cfg, progress=False)

    import shutil

    straight = go("optimizer+params:streamed", 4, "straight")
    assert kinds(straight["run"].state.params) == {ol.HOST}
    go("none", 4, "plain")
    # resume the same run from its step-2 checkpoint (same schedule: train.steps=4)
    shutil.copytree(tmp_path / "straight", tmp_path / "resumed")
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "4")
    resumed = go("optimizer+params:streamed", 4, "resumed")
    assert resumed["run"].start_step == 2
    want = _losses(tmp_path / "straight")
    assert sorted(want) == [1, 2, 3, 4]
    plain = _losses(tmp_path / "plain")  # equal to rounding (the params differ in the last place)
    np.testing.assert_allclose([want[k] for k in sorted(want)], [plain[k] for k in sorted(plain)], rtol=1e-6)
    (tmp_path / "straight" / "metrics.jsonl").unlink()
    assert _losses(tmp_path / "resumed") == want
    assert_matches(straight["run"].state.params, resumed["run"].state.params, bound=0.0)
