"""The GRPO step on a fixed batch: the reference (frozen starting weights in model state, beta >
0) or none (beta 0), old log-probs for the clipped ratio, under every strategy equal to one
device; and the LoRA reference is the base with adapters off."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from fsdp_jax.app.models.lora import LoraSpec, adapter_mask
from fsdp_jax.app.objectives import with_reference
from fsdp_jax.app.objectives.grpo import GrpoSpec, finish_metrics
from fsdp_jax.app.objectives.grpo_loss import make_grpo_loss
from fsdp_jax.app.trainer.build import lora_optimizer, trainer_model
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from helpers import TINY

N, P = 6, 8


def grpo_batch(rows=16, seed=0) -> dict:
    rng = np.random.default_rng(seed)
    plen = rng.integers(2, P + 1, rows).astype(np.int32)
    clen = rng.integers(1, N + 1, rows)
    mask = (np.arange(N)[None] < clen[:, None]).astype(np.int32)
    comp = rng.integers(3, 256, (rows, N)).astype(np.int32) * mask
    tokens = np.zeros((rows, P + N), np.int32)
    for i in range(rows):
        tokens[i, : plen[i]] = rng.integers(3, 256, plen[i])
        tokens[i, plen[i] : plen[i] + N] = comp[i]
    return {
        "tokens": tokens,
        "prompt_len": plen,
        "completion": comp,
        "completion_mask": mask,
        "advantages": rng.normal(size=rows).astype(np.float32),
        "old_logps": (np.log(1 / 256) + rng.normal(size=(rows, N)) * 0.3).astype(np.float32),
    }


def run_steps(strategy, mesh_shape, spec, lora=False, steps=3):
    model = trainer_model(TINY, "none", LoraSpec(4, 8.0, ("wq", "wv", "w_up")) if lora else None)
    mesh = make_mesh(*mesh_shape, devices=jax.devices()[: int(np.prod(mesh_shape))])
    tx = optax.adamw(3e-3)
    if lora:
        loss_fn = make_grpo_loss(model, spec, "adapters_off")
        kw = dict(trainable=adapter_mask)
        tx = lora_optimizer(tx)
    else:
        model = with_reference(model) if spec.beta else model
        loss_fn, kw = make_grpo_loss(model, spec, "state" if spec.beta else "none"), {}
    built = build(model, tx, mesh, strategy, loss_fn=loss_fn, has_aux=True, min_shard_size=0, **kw)
    state = built.init_state(jax.random.key(0))
    batch = grpo_batch()
    out = []
    for _ in range(steps):
        state, m = built.train_step(state, batch)
        out.append({"loss": float(m["loss"]), **finish_metrics([jax.device_get(m["aux"])], spec.beta)})
    return out


SPEC = GrpoSpec(num_generations=4, max_new_tokens=N, beta=0.1, loss_type="grpo", epsilon_high=0.28)


@pytest.mark.slow
def test_full_shard_equals_one_device_and_the_reference_stays():
    one = run_steps("no_shard", (1, 1, 1), SPEC)
    full = run_steps("full_shard", (1, 8, 1), SPEC)
    assert one[0]["kl"] == 0.0 and one[-1]["kl"] > 0  # policy == reference at the first step only
    assert one[0]["clip_ratio/region_mean"] > 0  # the old log-probs clip some tokens
    for a, b in zip(one, full):
        for k in a:
            assert abs(a[k] - b[k]) < 2e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])


@pytest.mark.slow
@pytest.mark.parametrize("strategy, shape", [("shard_grad_op", (1, 8, 1)), ("hybrid_shard", (2, 4, 1))])
def test_every_strategy_equals_one_device_beta0(strategy, shape):
    spec = GrpoSpec(num_generations=4, max_new_tokens=N, beta=0.0, loss_type="dr_grpo")
    one = run_steps("no_shard", (1, 1, 1), spec, steps=2)
    other = run_steps(strategy, shape, spec, steps=2)
    for a, b in zip(one, other):
        for k in a:
            assert abs(a[k] - b[k]) < 2e-5 * max(1.0, abs(a[k])), (strategy, k, a[k], b[k])


@pytest.mark.slow
def test_lora_reference_is_the_base_with_adapters_off():
    one = run_steps("no_shard", (1, 1, 1), SPEC, lora=True)
    full = run_steps("full_shard", (1, 8, 1), SPEC, lora=True)
    assert one[0]["kl"] == 0.0 and one[-1]["kl"] > 0  # B starts at zero: policy == base == reference
    for a, b in zip(one, full):
        for k in a:
            assert abs(a[k] - b[k]) < 2e-5 * max(1.0, abs(a[k])), (k, a[k], b[k])
