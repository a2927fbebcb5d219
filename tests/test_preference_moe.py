"""A mixture of experts under a preference loss (issue 57): the policy's router terms are added
to the pair loss (TRL adds `router_aux_loss_coef` x the load-balancing loss when the model
outputs router logits), the router sees the real tokens only, and a run through the CLI logs
TRL's preference metrics beside the router's."""

import dataclasses
import functools
import json

import jax
import numpy as np
import pytest

from helpers import ROOT, call

CONFIG = ROOT / "configs" / "dpo_tiny.yaml"
MOE = ["model.n_experts=4", "model.experts_per_token=2", "model.moe_ffn_dim=64"]


def _pairs(p: int, length: int, vocab: int, seed: int = 0):
    """(P, 2, L) pairs: a prompt, completions of different lengths, right padding."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, vocab, (p, 2, length)).astype(np.int32)
    attention = np.zeros((p, 2, length), np.int32)
    completion = np.zeros((p, 2, length), np.int32)
    for i in range(p):
        for j in range(2):
            end = length - 3 - (i + 2 * j) % 7
            attention[i, j, :end] = 1
            completion[i, j, 6:end] = 1
    return {"tokens": tokens * attention, "attention": attention, "completion": completion}


@pytest.fixture(scope="module")
def moe():
    from fsdp_jax.app.trainer.build import trainer_model
    from fsdp_jax.app.trainer.setup import load_run_config

    cfg = load_run_config(CONFIG, MOE)
    model = trainer_model(cfg.model, "none")
    params = jax.jit(model.init)(jax.random.key(0))  # one compile, not one per op of an eager init
    return cfg, model, params, _pairs(4, cfg.data.seq_len + 1, cfg.model.vocab_size)


@pytest.mark.slow
def test_router_terms_are_added_to_the_pair_loss_over_the_real_tokens(moe):
    from fsdp_jax.app.objectives.preference import PreferenceSpec
    from fsdp_jax.app.objectives.reference import make_preference_loss, pair_logits
    from fsdp_jax.app.trainer.router_metrics import router_terms

    cfg, model, params, batch = moe
    spec = PreferenceSpec("dpo", beta=0.1)
    ref = {"ref_logps": np.zeros((4, 2), np.float32)}
    coef = dataclasses.replace(cfg.model, router_aux_loss_coef=0.01, router_z_loss_coef=0.001)
    plain = jax.jit(make_preference_loss(model, spec, "precomputed"))
    routed = jax.jit(make_preference_loss(model, spec, "precomputed", functools.partial(router_terms, coef)))
    # on the host (numpy): the checks' arithmetic, not an eager op (a compile) each
    (l0, a0), (l1, a1) = jax.device_get((plain(params, {**batch, **ref}), routed(params, {**batch, **ref})))
    r = a1["router"]
    assert "router" not in a0 and a1["rewards/margins"] == a0["rewards/margins"]
    np.testing.assert_allclose(l1 - l0, 0.01 * r["router_aux_loss"] + 0.001 * r["router_z_loss"], rtol=1e-5)
    # the router's statistics are over the real tokens: padding (attention 0) routed nowhere
    terms = jax.jit(lambda p, b: router_terms(coef, pair_logits(model, p, b, router=True)[1])[0])
    unmasked = {**batch, "attention": np.ones_like(batch["attention"])}
    real = int(batch["attention"][..., :-1].sum())
    assert float(np.asarray(jax.tree.leaves(r["expert_load"])[0]).sum()) > 0
    assert not np.allclose(np.asarray(terms(params, batch)), np.asarray(terms(params, unmasked)))
    assert real < batch["attention"][..., :-1].size  # the batch has padding to leave out


@pytest.mark.slow
def test_moe_dpo_run_logs_preference_and_router_metrics(tmp_path, capsys):
    rows = [{"prompt": f"reverse w{i}: ", "chosen": f"{i}w\n", "rejected": f"w{i}\n"} for i in range(16)]
    data = tmp_path / "p.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run = tmp_path / "run"
    rc, out, err = call(
        "train", "--config", CONFIG, *MOE, "model.router_aux_loss_coef=0.01", f"data.path={data}",
        f"run_dir={run}", "train.steps=2", "train.log_every=1", "--no-progress", capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train = [r for r in recs if "loss" in r]
    assert len(train) == 2
    for r in train:
        assert {"rewards/margins", "rewards/accuracies", "logps/chosen", "router_aux_loss", "expert_load_max"} <= set(r)
        assert r["router_aux_loss"] > 0
    # step 1: policy == reference, so the pair loss is log 2 and the rest is the router's term
    assert train[0]["loss"] == pytest.approx(np.log(2) + 0.01 * train[0]["router_aux_loss"], rel=1e-5)
