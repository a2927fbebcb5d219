"""DeepSeek-V3's aux-loss-free balancing (app/trainer/expert_bias.py) on the tiny golden
(tests/golden/make_hf_deepseek_goldens.py): after a step every sparse layer's score-correction
bias moved by u * sign(mean load - load), the loads recomputed here from transformers' own
router logits (the independent reference); no gradient, no optimizer state; under every
strategy and expert parallelism as on one device; exact across a checkpoint and resume."""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_deepseek_v3 import EP, NAME, _numpy_choice, golden
from test_hf import GOLDEN, MESHES

from fsdp_jax.app.config.checks import validate
from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.models import Decoder, count_params
from fsdp_jax.app.trainer.build import make_loss_fn
from fsdp_jax.app.trainer.expert_bias import bias_rule, moved, without_bias_state
from fsdp_jax.app.trainer.optim import decay_mask
from fsdp_jax.checkpoint import Checkpointer
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile
from fsdp_jax.errors import ConfigError
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from helpers import call

U = 2.0**-9  # the bias update speed: a power of two, so the reference's float32 sums are the step's
ROWS = 8  # the golden's 2 rows 4 times: a batch every mesh of 8 devices divides
SPARSE = (1, 2)  # the golden's sparse layers (layer 0 is dense)
BIAS = ("segments", 1, "layers", 0, "moe", "score_bias")  # (2, 8): layers 1 and 2 stacked


def _bias(params) -> np.ndarray:
    for k in BIAS:
        params = params[k]
    return np.asarray(params)


def reference_counts() -> dict[int, np.ndarray]:
    """Per sparse layer, the tokens routed to each expert, from transformers' router logits of
    the 39 input positions of each golden row (the step's inputs: tokens[:, :-1]), per copy."""
    g, f = golden(), SafetensorsFile(GOLDEN / NAME / "model.safetensors")
    out = {}
    for layer in SPARSE:
        logits = g[f"router_logits_{layer}"].reshape(2, 40, 8)[:, :39].reshape(-1, 8)
        bias = f.read(f"model.layers.{layer}.mlp.gate.e_score_correction_bias")
        out[layer] = np.bincount(_numpy_choice(logits, bias).ravel(), minlength=8)
    return out


def reference_rule(bias: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The report's rule in numpy, float32: b + u * sign(mean load - load)."""
    return (bias.astype(np.float32) + np.float32(U) * np.sign(counts.mean() - counts).astype(np.float32)).astype(
        np.float32
    )


def build_run(mesh, strategy="full_shard", rules=None, microbatches=1):
    """The golden's AdamW step with the rule on `mesh` under `strategy` (one trace and compile
    for every `run` from it)."""
    ckpt = hf.HFCheckpoint(GOLDEN / NAME)
    cfg = dataclasses.replace(ckpt.config, bias_update_speed=U)
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    tx = without_bias_state(optax.adamw(1e-2, weight_decay=0.1, mask=decay_mask))
    return build(
        m,
        tx,
        mesh,
        strategy,
        loss_fn=make_loss_fn(m, cfg),
        has_aux=True,
        rules=rules,
        min_shard_size=0,
        microbatches=microbatches,
        post_update=bias_rule(cfg),
    )


def run(built, steps=1, resume_dir=None):
    """`steps` steps of `built` (`build_run`) from the golden on its tokens: (bias after each step,
    aux of the first step, losses, the opt state's leaves); `resume_dir`: checkpoint after step 1,
    restore, go on."""
    state = built.state_from_params(hf.load_params(hf.HFCheckpoint(GOLDEN / NAME), built.abstract_state.params))
    batch = jnp.asarray(np.tile(golden()["tokens"], (ROWS // 2, 1)), jnp.int32)
    biases, losses, first = [], [], None
    for i in range(steps):
        state, metrics = built.train_step(state, batch)
        biases.append(_bias(state.params))
        losses.append(float(metrics["loss"]))
        first = metrics["aux"] if first is None else first
        if resume_dir is not None and i == 0:
            saver = Checkpointer(resume_dir)
            saver.save(1, state)
            saver.close()
            state = Checkpointer(resume_dir, read_only=True).restore(built.abstract_state, 1).state
    return biases, first, np.asarray(losses), jax.tree.leaves(state.opt_state)


@pytest.fixture(scope="module")
def one_device_built():
    return build_run(make_mesh(1, 1, 1, devices=jax.devices()[:1]))


@pytest.fixture(scope="module")
def one_device(one_device_built):
    return run(one_device_built, steps=2)


@pytest.mark.slow  # one train-step compile of the golden: 12-16 s here
def test_step_moves_the_bias_by_the_rule_from_transformers_loads(one_device):
    biases, aux, _, opt_leaves = one_device
    want = reference_counts()
    counts = np.asarray(aux["expert_counts"])  # (L, E)
    assert counts.shape == (3, 8) and not counts[0].any()  # the dense layer routes nothing
    for layer in SPARSE:
        assert np.array_equal(counts[layer], ROWS // 2 * want[layer]), layer
    f = SafetensorsFile(GOLDEN / NAME / "model.safetensors")
    bias0 = np.stack([f.read(f"model.layers.{i}.mlp.gate.e_score_correction_bias") for i in SPARSE])
    step1 = np.stack([reference_rule(bias0[r], want[i]) for r, i in enumerate(SPARSE)])
    assert np.array_equal(biases[0], step1)  # bit for bit: no gradient, no decay, the rule only
    assert not np.array_equal(biases[1], biases[0])  # step 2 moves it again, by its own loads
    step2 = np.abs(biases[1] - biases[0])
    assert np.allclose(step2, U, rtol=1e-5, atol=0) or np.allclose(step2[step2 > 0], U, rtol=1e-5, atol=0)
    # no optimizer state for it: AdamW's mu and nu hold every param but the two (8,) biases
    n_params = count_params(hf.HFCheckpoint(GOLDEN / NAME).config)
    assert sum(x.size for x in opt_leaves if x.ndim) == 2 * (n_params - 16)


def test_rule_on_a_stack_is_per_layer():
    bias = jnp.zeros((2, 4), jnp.float32)
    counts = jnp.asarray([[3, 1, 2, 2], [0, 0, 0, 8]], jnp.float32)
    got = np.asarray(moved(bias, counts, 0.5))
    assert np.array_equal(got, [[-0.5, 0.5, 0.0, 0.0], [0.5, 0.5, 0.5, -0.5]])


@pytest.mark.slow
def test_every_strategy_and_expert_parallelism_match_one_device(one_device):
    biases, _, losses, _ = one_device
    cases = [(s, MESHES[s], None, 1) for s in MESHES] + [("full_shard", (1, 4, 2), EP, 2)]
    for strategy, shape, rules, mb in cases:
        got, _, got_losses, _ = run(build_run(make_mesh(*shape), strategy, rules, mb), 2)
        for a, b in zip(got, biases):
            assert np.array_equal(a, b), (strategy, shape)
        assert np.abs(got_losses / losses - 1).max() <= 1e-5, (strategy, got_losses, losses)


@pytest.mark.slow
def test_resume_continues_the_bias_exactly(one_device, one_device_built, tmp_path):
    """The one-device run again with a checkpoint and restore after step 1: the same step (its
    compile shared with the fixture's run), so only the resume can make it differ."""
    biases, _, losses, _ = one_device
    got, _, got_losses, _ = run(one_device_built, 2, resume_dir=tmp_path)
    assert np.array_equal(got[1], biases[1]) and np.array_equal(got_losses, losses)


@pytest.mark.slow
def test_train_command_moves_the_bias_by_the_rule_and_logs_the_sequence_term(tmp_path, corpus, capsys):
    """`fsdp-jax train` from the golden with the rule and alpha on (the trainer's wiring:
    `build_from_config`): metrics.jsonl logs the sequence-wise term, and the exported bias moved
    from the imported one by one step of u: -u, 0 or +u, not all zero (one step: with two, a large u
    can undo its own first move)."""
    run, out = tmp_path / "run", tmp_path / "hf"
    yml = tmp_path / "c.yaml"
    yml.write_text(f"init_from: hf:{GOLDEN / NAME}\nrun_dir: {run}\ndata: {{seq_len: 32, path: {corpus}}}\n")
    args = ["model.bias_update_speed=0.5", "model.seq_aux_loss_coef=0.001", "train.steps=1", "train.log_every=1"]
    rc, _, err = call("train", "--config", yml, "--no-progress", *args, "train.eval_every=0", capsys=capsys)
    assert rc == 0, err[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert all(r["router_seq_aux_loss"] > 0 for r in recs if "router_seq_aux_loss" in r) and recs
    rc, _, err = call("export", run, "--hf", out, capsys=capsys)
    assert rc == 0, err[-3000:]
    before, after = (SafetensorsFile(d / "model.safetensors") for d in (GOLDEN / NAME, out))
    for i in SPARSE:
        key = f"model.layers.{i}.mlp.gate.e_score_correction_bias"
        steps = (after.read(key).astype(np.float64) - before.read(key)) / 0.5
        assert np.allclose(steps, np.round(steps), atol=1e-5) and np.abs(steps).max() == pytest.approx(1), steps


def test_config_refuses_what_the_rule_cannot_run():
    cfg = load_config(GOLDEN.parents[1].parent / "configs" / "deepseek_v3.yaml")
    bad = [
        {"model": dataclasses.replace(cfg.model, n_group=0, topk_group=0, bias_update_speed=U)},
        {"model": dataclasses.replace(cfg.model, bias_update_speed=U), "offload": "optimizer:streamed"},
        {"model": dataclasses.replace(cfg.model, bias_update_speed=-1.0)},
    ]
    for change in bad:
        with pytest.raises(ConfigError, match="bias_update_speed"):
            validate(dataclasses.replace(cfg, **change))


@pytest.mark.slow  # two compiles of the golden's step (one device, full_shard): ~75 s of CPU here
def test_verify_runs_the_rule_and_compares_the_bias_exactly(tmp_path, capsys):
    """`fsdp-jax verify` on the tiny DeepSeek-V3 config with u > 0 runs the rule in each step as the
    trainer does: the one-device bias moved by exactly u after step 1 (it moved 0 when verify left it),
    and full_shard's bias equals it bit for bit at every judged step."""
    yml = tmp_path / "c.yaml"
    yml.write_text(f"init_from: hf:{GOLDEN / NAME}\ndata: {{seq_len: 16, source: none}}\ntrain: {{global_batch: 8}}\n")
    args = ["--strategies", "full_shard", "--steps", "2", "--json", f"model.bias_update_speed={U}"]
    rc, out, err = call("verify", "--config", yml, *args, capsys=capsys)
    assert rc == 0, err[-3000:] + out
    doc = json.loads(out)
    assert doc["passed"] and doc["exact"] == "score_bias" and doc["exact_moved"][0] == U, doc["exact_moved"]
    r = doc["strategies"]["full_shard"]
    judged = r["routing_flip_step"] or 3
    assert r["exact_diff"][: judged - 1] == [0.0] * (judged - 1) and judged > 1, r
    assert any("aux-loss-free rule" in n for n in doc["notes"])


def test_an_unequal_exact_leaf_fails_the_step_and_round_trips():
    """verify's exact comparison: a leaf off by one rule step is a divergence (not a tolerance), named,
    and the report's JSON keeps it."""
    from fsdp_jax.verify.compare import _over
    from fsdp_jax.verify.exact import exact_indices, max_abs_at, unequal
    from fsdp_jax.verify.report import TOLERANCES, StrategyReport, VerifyReport

    paths = ["a/w", "a/score_bias", "b/score_bias"]
    ref = [np.ones(3), np.zeros(2), np.zeros(2)]
    got = [np.ones(3), np.asarray([0.0, U]), np.zeros(2)]
    idx = exact_indices(paths, "score_bias")
    assert idx == [1, 2] and max_abs_at(got, ref, idx) == U
    tol = TOLERANCES["adaptive-f32"]  # a rel diff of 1 is far over it; U alone is under no tolerance's eye
    d = _over(0, paths, [0.0, 0.0, 0.0], 0.0, 0.0, tol, unequal(paths, got, ref, idx))
    assert d is not None and d.exact == (("a/score_bias", U),) and "compared exactly" in d.describe(tol)
    assert _over(0, paths, [0.0] * 3, 0.0, 0.0, tol, unequal(paths, ref, ref, idx)) is None
    r = StrategyReport(
        "full_shard",
        {"fsdp": 8},
        False,
        [0.0],
        [0.0],
        [0.0],
        U,
        "a/score_bias",
        None,
        {"total": 0},
        0,
        {},
        d,
        exact_diff=[U],
    )
    report = VerifyReport(8, 1, "cpu", tol, "adaptive", "f32", [1.0], [1.0], {"full_shard": r}, None, "score_bias", [U])
    assert VerifyReport.from_dict(json.loads(json.dumps(report.to_dict()))) == report
    assert "score_bias compared exactly" in report.format() and "(compared exactly)" in report.format()
    with pytest.raises(Exception, match="names no param leaf"):
        exact_indices(paths, "nothing")
