"""GRPO against TRL: GRPOTrainer's advantages (scale_rewards group / batch / none) and its
`_compute_loss` (loss_type grpo / bnpo / dr_grpo / dapo, beta 0 and > 0, epsilon_high,
temperature) on one batch of the tiny Llama 3 written by transformers
(tests/golden/make_grpo_goldens.py made the goldens in the golden venv): advantages, the
reference log-probs, the loss, the norm of its gradient and every logged metric within 1e-5 (f32)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fsdp_jax.app.config.grpo_schema import GrpoConfig
from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.models import Decoder
from fsdp_jax.app.objectives.grpo import (
    LOSS_TYPES,
    SCALE_REWARDS,
    GrpoSpec,
    finish_metrics,
    group_advantages,
    spec_problem,
)
from fsdp_jax.app.objectives.grpo_loss import batch_logps, make_grpo_loss
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from fsdp_jax.train.step import sharding_context

GOLDEN = Path(__file__).parent / "golden"
GOLDENS = json.loads((GOLDEN / "grpo" / "goldens.json").read_text())


def spec_of(cfg: dict) -> GrpoSpec:
    return GrpoSpec(
        num_generations=GOLDENS["num_generations"],
        max_new_tokens=GOLDENS["max_completion_length"],
        temperature=cfg["temperature"],
        epsilon=cfg["epsilon"],
        epsilon_high=cfg["epsilon_high"],
        beta=cfg["beta"],
        loss_type=cfg["loss_type"],
        scale_rewards=cfg["scale_rewards"],
    )


def golden_batch() -> dict:
    """TRL's left-padded prompts + completions -> our rows: prompt then completion, right-padded."""
    b = GOLDENS["batch"]
    pid, pm = np.asarray(b["prompt_ids"]), np.asarray(b["prompt_mask"])
    comp = np.asarray(b["completion_ids"], np.int32)
    n = comp.shape[1]
    tokens = np.zeros((len(pid), pid.shape[1] + n), np.int32)
    for i in range(len(pid)):
        row = pid[i][pm[i] == 1].tolist() + comp[i].tolist()
        tokens[i, : len(row)] = row
    return {
        "tokens": tokens,
        "prompt_len": pm.sum(1).astype(np.int32),
        "completion": comp,
        "completion_mask": np.asarray(b["completion_mask"], np.int32),
    }


def test_advantages_match_trl():
    b = GOLDENS["batch"]
    for scale, want in GOLDENS["advantages"].items():
        got, _ = group_advantages(b["rewards_per_func"], GOLDENS["reward_weights"], GOLDENS["num_generations"], scale)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=1e-5, err_msg=scale)
    # the all-equal group: zero advantages; scaled groups are not
    g = GOLDENS["num_generations"]
    adv, _ = group_advantages(b["rewards_per_func"], GOLDENS["reward_weights"], g, "group")
    assert np.allclose(adv[g : 2 * g], 0.0) and np.abs(adv).max() > 0.5


@pytest.fixture(scope="module")
def results():
    ckpt = hf.HFCheckpoint(GOLDEN / "hf" / "llama3", base=hf.DecoderConfig(scan_layers=True))
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    built = build(m, optax.sgd(0.1), make_mesh(1, 1, 1, devices=jax.devices()[:1]), "no_shard", min_shard_size=0)
    params = hf.load_params(ckpt, built.abstract_state.params)
    scale = jnp.float32(GOLDENS["ref_scale"])
    batch = {k: jnp.asarray(v) for k, v in golden_batch().items()}
    cases = GOLDENS["cases"]
    specs = {k: spec_of(c["config"]) for k, c in cases.items()}
    per_case = {
        k: {
            "advantages": jnp.asarray(GOLDENS["advantages"][c["config"]["scale_rewards"]], jnp.float32),
            "old_logps": jnp.asarray(c["old_per_token_logps"], jnp.float32),
        }
        for k, c in cases.items()
    }

    def all_cases(params, batch, per_case):
        ref_params = jax.tree.map(lambda x: x * scale, params)
        out = {}
        for k, s in specs.items():
            loss_fn = make_grpo_loss(m, s, "state")
            b = {**batch, **per_case[k]}
            (loss, aux), grads = jax.value_and_grad(lambda p: loss_fn(p, b, ref_params)[0], has_aux=True)(params)
            out[k] = (loss, aux, optax.tree.norm(grads), batch_logps(m, s, ref_params, b))
        return out

    with sharding_context(built.plan):
        return jax.device_get(jax.jit(all_cases)(params, batch, per_case)), specs


@pytest.mark.slow
def test_loss_metrics_and_grad_norm_match_trl(results):
    out, specs = results
    mask = np.asarray(GOLDENS["batch"]["completion_mask"], bool)
    for case, (loss, aux, gnorm, ref) in out.items():
        want = GOLDENS["cases"][case]
        np.testing.assert_allclose(np.asarray(ref)[mask], np.asarray(want["ref_per_token_logps"])[mask], atol=1e-5)
        got = {"loss": float(loss), "grad_norm": float(gnorm), **finish_metrics([aux], specs[case].beta)}
        assert set(want["out"]) <= set(got), (case, set(want["out"]) - set(got))
        for k, v in want["out"].items():
            assert abs(got[k] - v) <= 1e-5 * max(1.0, abs(v)), (case, k, got[k], v)


def test_cases_cover_the_loss_options():
    cfgs = [c["config"] for c in GOLDENS["cases"].values()]
    assert {c["loss_type"] for c in cfgs} == {"grpo", "bnpo", "dr_grpo", "dapo"}
    assert {c["scale_rewards"] for c in cfgs} == {"group", "batch", "none"}
    assert any(c["beta"] == 0 for c in cfgs) and any(c["beta"] > 0 for c in cfgs)
    assert any(c["epsilon_high"] != c["epsilon"] for c in cfgs) and any(c["temperature"] != 1 for c in cfgs)
    # the clipped ratio is exercised on both sides
    outs = [c["out"] for c in GOLDENS["cases"].values()]
    assert all(o["clip_ratio/low_mean"] > 0 and o["clip_ratio/high_mean"] > 0 for o in outs)


def test_spec_problems():
    assert spec_problem(GrpoSpec()) is None
    assert spec_problem(GrpoSpec(num_generations=1))[0] == "num_generations"
    assert spec_problem(GrpoSpec(loss_type="ppo"))[0] == "loss_type"
    assert spec_problem(GrpoSpec(scale_rewards="yes"))[0] == "scale_rewards"
    assert spec_problem(GrpoSpec(top_p=0.0))[0] == "top_p"
    assert spec_problem(GrpoSpec(beta=-0.1))[0] == "beta"
    assert spec_problem(GrpoSpec(num_iterations=0))[0] == "num_iterations"
    assert GrpoSpec(epsilon=0.2).eps_high == 0.2 and GrpoSpec(epsilon_high=0.28).eps_high == 0.28


def test_config_choices_are_the_objective_s():
    fields = {f.name: f.metadata.get("choices") for f in dataclasses.fields(GrpoConfig)}
    assert fields["loss_type"] == LOSS_TYPES and fields["scale_rewards"] == SCALE_REWARDS
    assert GrpoConfig().loss_type == GrpoSpec().loss_type and GrpoConfig().epsilon == GrpoSpec().epsilon
