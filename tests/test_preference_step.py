"""The preference step: the reference forward in the same step (frozen starting weights in
model state, or the LoRA base with adapters off), under every strategy equal to one device."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from fsdp_jax.app.models.lora import LoraSpec, adapter_mask
from fsdp_jax.app.objectives import PreferenceSpec, finish_metrics, make_preference_loss, with_reference
from fsdp_jax.app.objectives.preference_data import PairIds, collate
from fsdp_jax.app.trainer.build import lora_optimizer, trainer_model
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from helpers import TINY

LN2 = float(np.log(2.0))


def pair_batch(n_pairs=8, length=24, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    pairs = []
    for _ in range(n_pairs):
        p = rng.integers(3, 256, rng.integers(3, 8)).tolist()
        pairs.append(PairIds(p, rng.integers(3, 256, rng.integers(2, 9)).tolist(), rng.integers(3, 256, 5).tolist()))
    return collate(pairs, length)


def run_steps(strategy, mesh_shape, spec, lora=False, steps=3):
    model = trainer_model(TINY, "none", LoraSpec(4, 8.0, ("wq", "wv", "w_up")) if lora else None)
    devices = jax.devices()[: int(np.prod(mesh_shape))]
    mesh = make_mesh(*mesh_shape, devices=devices)
    tx = optax.adamw(3e-3)
    if lora:
        built = build(
            model,
            lora_optimizer(tx),
            mesh,
            strategy,
            loss_fn=make_preference_loss(model, spec, "adapters_off"),
            has_aux=True,
            trainable=adapter_mask,
            min_shard_size=0,
        )
    else:
        model = with_reference(model)
        loss_fn = make_preference_loss(model, spec, "state")
        built = build(model, tx, mesh, strategy, loss_fn=loss_fn, has_aux=True, min_shard_size=0)
    state = built.init_state(jax.random.key(0))
    batch = pair_batch()
    out = []
    for _ in range(steps):
        state, m = built.train_step(state, batch)
        out.append({"loss": float(m["loss"]), **finish_metrics([jax.device_get(m["aux"])])})
    return out, jax.device_get(state)


@pytest.mark.slow
def test_reference_in_model_state_full_shard_equals_one_device():
    spec = PreferenceSpec("dpo", beta=0.5)
    one, s1 = run_steps("no_shard", (1, 1, 1), spec)
    full, s8 = run_steps("full_shard", (1, 8, 1), spec)
    assert abs(one[0]["loss"] - LN2) < 1e-6 and one[0]["rewards/margins"] == 0.0  # policy == reference at step 0
    assert one[-1]["rewards/margins"] > 0 and one[-1]["rewards/accuracies"] > 0.5  # it learns the preference
    for a, b in zip(one, full):
        for k in a:
            assert abs(a[k] - b[k]) < 2e-5, (k, a[k], b[k])
    # the reference stayed the starting weights while the policy moved
    init = jax.device_get(with_reference(trainer_model(TINY)).init(jax.random.key(0)))
    for ref, p0, p in zip(*(jax.tree.leaves(t) for t in (s8.model_state, init, s8.params))):
        np.testing.assert_allclose(ref, p0, rtol=0, atol=1e-7)  # sharded init vs one device: ulps
    assert any(float(np.abs(p - p0).max()) > 0 for p, p0 in zip(jax.tree.leaves(s8.params), jax.tree.leaves(init)))


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, shape", [("shard_grad_op", (1, 8, 1)), ("shard_opt", (1, 8, 1)), ("hybrid_shard", (2, 4, 1))]
)
def test_reference_every_strategy_equals_one_device(strategy, shape):
    spec = PreferenceSpec("ipo", beta=0.5)
    one, _ = run_steps("no_shard", (1, 1, 1), spec, steps=2)
    other, _ = run_steps(strategy, shape, spec, steps=2)
    for a, b in zip(one, other):
        for k in a:
            assert abs(a[k] - b[k]) < 2e-5 * max(1.0, abs(a[k])), (strategy, k, a[k], b[k])


@pytest.mark.slow
def test_lora_reference_is_the_base_with_adapters_off():
    spec = PreferenceSpec("dpo", beta=0.5)
    one, s1 = run_steps("no_shard", (1, 1, 1), spec, lora=True)
    full, _ = run_steps("full_shard", (1, 8, 1), spec, lora=True)
    assert abs(one[0]["loss"] - LN2) < 1e-6  # B starts at zero: policy == base == reference
    assert one[-1]["rewards/margins"] > 0
    assert s1.model_state is None  # no second copy of the weights
    for a, b in zip(one, full):
        for k in a:
            assert abs(a[k] - b[k]) < 2e-5, (k, a[k], b[k])


@pytest.mark.slow
def test_reference_stored_in_the_compute_dtype_trains_the_same_to_the_bit():
    """A bf16-compute run stores its frozen reference in bf16 (half an f32 copy): the step's
    reference forward casts it to the policy's compute dtype anyway (`as_compute`), so two
    steps' losses and metrics are bit-identical to an f32-stored reference's, on a model
    state of half the bytes."""
    import jax.numpy as jnp

    model = trainer_model(TINY, "none")
    mesh = make_mesh(1, 8, devices=jax.devices()[:8])
    runs = {}
    for name, dtype in (("f32", None), ("bf16", jnp.bfloat16)):
        m = with_reference(model, dtype)
        built = build(
            m, optax.adamw(3e-3), mesh, "full_shard", loss_fn=make_preference_loss(m, PreferenceSpec("dpo", 0.1), "state"),
            has_aux=True, min_shard_size=0, precision="params=float32,compute=bfloat16",
        )  # fmt: skip
        state = built.init_state(jax.random.key(0))
        out = []
        for _ in range(2):
            state, metrics = built.train_step(state, pair_batch())
            out.append(jax.device_get(metrics))
        runs[name] = (out, sum(x.nbytes for x in jax.tree.leaves(state.model_state)))
    (a, bytes32), (b, bytes16) = runs["f32"], runs["bf16"]
    assert bytes16 * 2 == bytes32
    for x, y in zip(a, b):
        assert float(x["loss"]) == float(y["loss"])
        for k in x["aux"]:
            assert np.array_equal(np.asarray(x["aux"][k]), np.asarray(y["aux"][k])), k
