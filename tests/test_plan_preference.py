"""`plan` plans the preference step the trainer runs (issue 57 item 5): the policy and its
frozen reference (a second copy of the weights in model state, no gradients, no optimizer
state), pairs of rows (B, 2, S + 1) per step; the compiled argument bytes equal the analytic
params + optimizer exactly (plus the pair arrays the loss reads). Under LoRA the reference is the base with the
adapters off: no second copy."""

import json

import pytest

from helpers import call


def _plan(capsys, config, *overrides):
    rc, out, err = call(
        "plan", "--config", config, "--devices", "8", "--strategies", "full_shard", "--json", *overrides, capsys=capsys
    )
    assert rc == 0, err[-3000:]
    return json.loads(out)["strategies"]["full_shard"]


@pytest.mark.slow
def test_dpo_plan_counts_the_reference_and_the_pairs(capsys):
    dpo = _plan(capsys, "configs/dpo_tiny.yaml")
    sft = _plan(capsys, "configs/dpo_tiny.yaml", "objective=sft", "data.source=none")
    a, c = dpo["analytic"], dpo["compiled"]
    # exact for the state, the reference included; of the pair arrays XLA keeps those the loss reads
    assert a["params"] + a["optimizer"] < c["argument"] <= a["params"] + a["optimizer"] + a["batch"]
    s = sft["analytic"]
    assert a["params"] == s["params"]  # the policy's
    # plus its frozen reference (model state, counted with the optimizer's state): one copy, same dtype
    assert a["optimizer"] - s["optimizer"] == s["params"]
    assert a["activations"] == pytest.approx(2 * sft["analytic"]["activations"], rel=0.01)  # chosen + rejected


def test_predicted_step_counts_both_rows_and_the_reference_forward():
    """The step-time model's DPO step against the SFT step on the same rows (16 pairs = 32
    rows): the reference's forward costs a third of the policy's forward + backward (2 of 6
    FLOPs per param), so the compute time is 4/3 of SFT's and tokens/s (both rows counted, as
    the trainer logs them) 3/4; precomputed log-probs and reference-free losses cost nothing."""
    import dataclasses

    from fsdp_jax.app.planner.step_time import predict_roofline
    from fsdp_jax.app.trainer.setup import load_run_config

    dpo = load_run_config("configs/dpo_tiny.yaml", [])
    sft = load_run_config("configs/dpo_tiny.yaml", ["objective=sft", "data.source=none", "train.global_batch=32"])
    result = {"analytic": {"grads": 0, "params": 0, "optimizer": 0}, "communication": {}}  # compute only

    def compute(cfg, *overrides):
        for o in overrides:
            cfg = dataclasses.replace(cfg, **o)
        return predict_roofline(cfg, "h100", 8, result)

    d, s = compute(dpo), compute(sft)
    assert d["compute_s"] / s["compute_s"] == pytest.approx(4 / 3, rel=1e-3)
    assert d["tokens_per_s_per_gpu"] / s["tokens_per_s_per_gpu"] == pytest.approx(3 / 4, rel=1e-3)
    assert d["mfu"] == pytest.approx(s["mfu"], rel=1e-3)  # the reference's forward is model work too
    pre = dataclasses.replace(dpo.preference, precompute_ref_log_probs=True)
    assert compute(dpo, {"preference": pre})["compute_s"] == pytest.approx(s["compute_s"], rel=1e-3)
    assert compute(dpo, {"objective": "simpo"})["compute_s"] == pytest.approx(s["compute_s"], rel=1e-3)
