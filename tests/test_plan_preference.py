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
