"""`fsdp-jax verify` on a GRPO config checks the GRPO step (issue 58): the GRPO loss with its
frozen reference in model state (beta > 0) and the sampling log-probs (num_iterations > 1) on
batches of the trainer's GRPO shapes, each strategy against one device."""

from __future__ import annotations

import json

import pytest

from helpers import ROOT, call


@pytest.mark.slow
def test_verify_runs_the_grpo_step(capsys):
    args = ["--config", ROOT / "configs" / "grpo_tiny.yaml", "--strategies", "full_shard", "--steps", "2", "--json"]
    rc, out, err = call("verify", *args, "init_from=null", "grpo.beta=0.04", "grpo.num_iterations=2", capsys=capsys)
    assert rc == 0, err[-2000:]
    doc = json.loads(out)
    assert any("random GRPO rows (64 x 8 + 6 tokens" in n and "sampling log-probs" in n for n in doc["notes"])
    assert doc["passed"] is True, doc
