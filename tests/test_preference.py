"""Preference objectives against TRL: DPOTrainer's sigmoid / ipo / hinge (and conservative
DPO), CPOTrainer's simpo, ORPOTrainer's orpo on one batch of a tiny Llama 3 and Qwen3
written by transformers (tests/golden/make_preference_goldens.py made the goldens in the
golden venv); the loss and every logged metric within 1e-5 (f32)."""

from __future__ import annotations

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.models import Decoder
from fsdp_jax.app.objectives import PreferenceSpec, finish_metrics, preference_terms, reference_logps, spec_problem
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from fsdp_jax.train.step import sharding_context

GOLDEN = Path(__file__).parent / "golden"
GOLDENS = json.loads((GOLDEN / "preference" / "goldens.json").read_text())


def spec_of(case: dict) -> PreferenceSpec:
    kind = {"dpo": None, "cdpo": "dpo", "cpo": "simpo", "orpo": "orpo"}[case["trainer"]]
    loss = kind or {"sigmoid": "dpo"}.get(case.get("loss_type"), case.get("loss_type"))
    return PreferenceSpec(
        loss=loss,
        beta=case["beta"],
        label_smoothing=case.get("label_smoothing", 0.0),
        simpo_gamma=case.get("simpo_gamma", 0.5),
        cpo_alpha=case.get("cpo_alpha", 0.0),
    )


def golden_batch() -> dict:
    """TRL's collated rows [chosen..., rejected...] -> (P, 2, L)."""
    b = GOLDENS["batch"]
    out = {}
    for ours, theirs in (("tokens", "input_ids"), ("attention", "attention_mask"), ("completion", "completion_mask")):
        x = np.asarray(b[theirs], np.int32)
        p = x.shape[0] // 2
        out[ours] = np.stack([x[:p], x[p:]], axis=1)
    return out


@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_losses_and_metrics_match_trl(name):
    ckpt = hf.HFCheckpoint(GOLDEN / "hf" / name, base=hf.DecoderConfig(scan_layers=True))
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    import optax

    # one device: parity with TRL is about the math (strategies: test_preference_step.py), and no
    # cross-device rendezvous can time out on a loaded machine
    built = build(m, optax.sgd(0.1), make_mesh(1, 1, 1, devices=jax.devices()[:1]), "no_shard", min_shard_size=0)
    params = hf.load_params(ckpt, built.abstract_state.params)
    scale = GOLDENS["ref_scale"]
    cases = {k: spec_of(v) for k, v in GOLDENS["cases"].items()}
    batch = {k: jnp.asarray(v) for k, v in golden_batch().items()}

    def all_cases(params, batch):
        ref = reference_logps(m, jax.tree.map(lambda x: x * jnp.float32(scale), params), batch)
        p = batch["tokens"].shape[0]
        logits = m.apply(params, batch["tokens"][..., :-1].reshape(2 * p, -1))
        return {k: preference_terms(s, logits, batch, ref) for k, s in cases.items()}

    with sharding_context(built.plan):
        out = jax.device_get(jax.jit(all_cases)(params, batch))
    want_all = GOLDENS[name]
    for case, (loss, aux) in out.items():
        got = {"loss": float(loss), **finish_metrics([aux])}
        want = want_all[case]
        for k, v in want.items():
            assert abs(got[k] - v) <= 1e-5 * max(1.0, abs(v)), (name, case, k, got[k], v)
        if cases[case].loss in ("simpo", "orpo"):  # CPO / ORPO log logits/* over padding too: not compared
            assert set(want) - {"loss"} <= set(got)


def test_spec_problems():
    assert spec_problem(PreferenceSpec()) is None
    assert spec_problem(PreferenceSpec(beta=0.0))[0] == "beta"
    assert spec_problem(PreferenceSpec(beta=-1.0))[0] == "beta"
    assert spec_problem(PreferenceSpec(label_smoothing=0.5))[0] == "label_smoothing"
    assert spec_problem(PreferenceSpec(label_smoothing=-0.1))[0] == "label_smoothing"
    assert spec_problem(PreferenceSpec(loss="kto"))[0] == "loss"
    assert not PreferenceSpec(loss="orpo").needs_reference and PreferenceSpec(loss="ipo").needs_reference
