"""`fsdp-jax train objective=dpo ...`: bad preference input in one line (exit 2, nothing
written), and a DPO run that resumes exactly and exports as before."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from helpers import ROOT, call, one_line

CONFIG = ROOT / "configs" / "dpo_tiny.yaml"


def prefs(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


GOOD = [{"prompt": f"reverse w{i}: ", "chosen": f"{i}w\n", "rejected": f"w{i}\n"} for i in range(32)]


@pytest.mark.parametrize(
    "rows, extra, words",
    [
        ([{"prompt": "a", "chosen": "b"}], [], ['no "rejected"', ":1"]),
        ([{"prompt": "a", "rejected": "b"}], [], ['no "chosen"']),
        ([{"prompt": "a", "chosen": "", "rejected": "b"}], [], ["chosen completion is empty"]),
        ([{"prompt": "x" * 40, "chosen": "b", "rejected": "c"}], [], ["fills the whole row"]),
        (GOOD, ["preference.beta=0"], ["preference.beta"]),
        (GOOD, ["preference.label_smoothing=0.5"], ["preference.label_smoothing", "[0, 0.5)"]),
        (GOOD, ["objective=kto"], ["objective", "dpo"]),
        (GOOD, ["preference.truncation=middle"], ["preference.truncation"]),
        (GOOD, ["preference.eval_path=no/such/pairs.jsonl"], ["preference.eval_path", "no such file"]),
        (
            [{"prompt": "p", "chosen": "x" * 20, "rejected": "y" * 20}],
            ["preference.packing=true"],
            ["p.jsonl:1", "longer than a packed row", "preference.max_length <= 16"],
        ),
    ],
)
def test_bad_preference_input_one_line(tmp_path, capsys, rows, extra, words):
    data, run = prefs(tmp_path / "p.jsonl", rows), tmp_path / "run"
    rc, _, err = call(
        "train", "--config", CONFIG, f"data.path={data}", f"run_dir={run}", *extra, "--no-progress", capsys=capsys
    )
    one_line(rc, err, *words)
    assert not run.exists()


@pytest.mark.slow
def test_dpo_resumes_exactly_and_exports(tmp_path, capsys):
    data = prefs(tmp_path / "p.jsonl", GOOD[:16])  # one global batch: every step trains on all 16 pairs, reshuffled
    common = ["--config", CONFIG, f"data.path={data}", "train.log_every=1", "train.checkpoint_every=2"]
    common += [f"preference.eval_path={data}", "train.eval_every=2"]  # held out: here the same 16 pairs
    straight, split = tmp_path / "straight", tmp_path / "split"
    rc, out, err = call(
        "train", *common, f"run_dir={straight}", "train.steps=4", "train.sample_tokens=8", "--no-progress", capsys=capsys
    )  # fmt: skip
    assert rc == 0, err[-2000:]
    assert "sample:\nreverse w" in out  # text from the policy, prompted with a held-out pair's prompt
    from fsdp_jax.app.trainer.loop import train
    from fsdp_jax.app.trainer.setup import load_run_config

    over = [str(a) for a in common[2:]] + [f"run_dir={split}", "train.steps=4"]
    assert train(load_run_config(CONFIG, over), progress=False, stop_after=2)["preempted"] == "stop_after=2"
    rc, out, err = call("train", *common, f"run_dir={split}", "train.steps=4", "--no-progress", capsys=capsys)
    assert rc == 0 and "resuming from checkpoint step 2" in out, err[-2000:]

    def rows(run):
        return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}

    a, b = rows(straight), rows(split)
    for step in (3, 4):
        for k in ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logits/rejected"):
            assert a[step][k] == b[step][k], (step, k, a[step][k], b[step][k])
    assert a[1]["rewards/margins"] == 0.0 and abs(a[1]["loss"] - 0.6931472) < 1e-6  # policy == reference at step 1

    def evals(run):
        return {
            r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_loss" in r
        }

    ea, eb = evals(straight), evals(split)
    assert sorted(ea) == [2, 4] and sorted(eb) == [4]  # none at a stop (split's step 2)
    names = ("loss", "rewards/chosen", "rewards/margins", "rewards/accuracies", "logps/chosen", "logits/rejected")
    for k in names:
        assert ea[4][f"eval_{k}"] == eb[4][f"eval_{k}"], (k, ea[4], eb[4])
        # the eval after step 2 scores the params step 3 trains from, on the same pairs (another order)
        assert abs(ea[2][f"eval_{k}"] - a[3][k]) <= 1e-5 * max(1.0, abs(a[3][k])), (k, ea[2], a[3])
    assert ea[2]["val_loss"] == ea[2]["eval_loss"] and ea[2]["eval_rewards/margins"] > 0
    rc, _, err = call("export", split, "--hf", tmp_path / "hf", capsys=capsys)
    assert rc == 0, err[-2000:]
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_precomputed_reference_equals_in_step_and_checks_the_data(tmp_path, capsys):
    data = prefs(tmp_path / "p.jsonl", GOOD)
    held = prefs(
        tmp_path / "held.jsonl",
        [{"prompt": f"reverse v{i}: ", "chosen": f"{i}v\n", "rejected": f"v{i}\n"} for i in range(20)],
    )
    common = ["--config", CONFIG, f"data.path={data}", "train.log_every=1", "train.steps=3"]
    common += [f"preference.eval_path={held}", "train.eval_every=3"]  # 20 pairs: 2 batches, the second wraps
    pre, inline = tmp_path / "pre", tmp_path / "inline"
    on = "preference.precompute_ref_log_probs=true"
    assert call("train", *common, f"run_dir={pre}", on, "--no-progress", capsys=capsys)[0] == 0
    assert call("train", *common, f"run_dir={inline}", "--no-progress", capsys=capsys)[0] == 0
    assert (pre / "ref_logps.npz").is_file() and not (inline / "ref_logps.npz").exists()
    assert (pre / "eval_ref_logps.npz").is_file() and not (inline / "eval_ref_logps.npz").exists()

    def rows(run, key="rewards/margins"):
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if f'"{key}"' in x]

    assert len(rows(pre)) == 3 and len(rows(pre, "eval_rewards/margins")) == 1
    for a, b in zip(rows(pre) + rows(pre, "eval_loss"), rows(inline) + rows(inline, "eval_loss")):
        for k in ("loss", "rewards/margins", "rewards/chosen", "logps/rejected"):
            k = k if "eval_loss" not in a else f"eval_{k}"
            assert abs(a[k] - b[k]) <= 1e-6, (a["step"], k, a[k], b[k])
    prefs(data, GOOD[:-1] + [{"prompt": "other ", "chosen": "a\n", "rejected": "b\n"}])  # the data changed
    rc, _, err = call("train", *common[:-1], "train.steps=4", f"run_dir={pre}", on, "--no-progress", capsys=capsys)
    one_line(rc, err, "ref_logps.npz", "does not match the dataset")


@pytest.mark.slow
def test_verify_compares_the_preference_step(tmp_path, capsys):
    """`verify` on a DPO config trains the trainer's preference step (pairs, the reference in
    model state) on one device and under a strategy: the first step's loss is log 2 (the policy
    is its reference), not a next-token loss on random tokens."""
    data = prefs(tmp_path / "p.jsonl", GOOD[:16])
    rc, out, err = call(
        "verify", "--config", CONFIG, "--steps", "2", "--strategies", "full_shard", f"data.path={data}", capsys=capsys
    )  # fmt: skip
    assert rc == 0, err[-2000:]
    assert "batches of pairs" in out and "reference loss 0.693147" in out and "PASS" in out, out


@pytest.mark.slow
def test_packed_pairs_resume_exactly_and_precompute_the_reference(tmp_path, capsys):
    """`preference.packing=true`: 32 pairs packed 3 to a row of 129 bytes; train.global_batch counts
    rows. A run stopped at step 2 and resumed equals an uninterrupted one bit for bit (steps and
    evals); with precomputed reference log-probs (per pair, gathered per row slot) every step and
    eval equals the in-step reference's within 1e-6; the held-out pairs are each scored once."""
    data = prefs(tmp_path / "p.jsonl", GOOD)
    common = ["--config", CONFIG, f"data.path={data}", "train.log_every=1", "train.checkpoint_every=2"]
    common += ["preference.packing=true", "data.seq_len=128", "model.max_seq_len=128", "train.global_batch=8"]
    common += [f"preference.eval_path={data}", "train.eval_every=2", "train.steps=4"]
    straight, split, pre = tmp_path / "straight", tmp_path / "split", tmp_path / "pre"
    rc, out, err = call("train", *common, f"run_dir={straight}", "--no-progress", capsys=capsys)
    assert rc == 0, err[-2000:]
    packed = re.search(r"packed 32 pairs into (\d+) rows of 129 tokens: efficiency ([\d.]+)", out)
    assert packed and int(packed[1]) <= 11 and float(packed[2]) > 0.5, out  # pairs of <= 42 bytes: 3 a row at least
    from fsdp_jax.app.trainer.loop import train
    from fsdp_jax.app.trainer.setup import load_run_config

    over = [str(a) for a in common[2:]] + [f"run_dir={split}"]
    assert train(load_run_config(CONFIG, over), progress=False, stop_after=2)["preempted"] == "stop_after=2"
    rc, out, err = call("train", *common, f"run_dir={split}", "--no-progress", capsys=capsys)
    assert rc == 0 and "resuming from checkpoint step 2" in out, err[-2000:]
    rc, _, err = call(
        "train", *common, f"run_dir={pre}", "preference.precompute_ref_log_probs=true", "--no-progress", capsys=capsys
    )  # fmt: skip
    assert rc == 0, err[-2000:]

    def records(run):
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]

    def by_step(run, key):
        return {r["step"]: r for r in records(run) if key in r}

    a, b, p = (by_step(r, "rewards/margins") for r in (straight, split, pre))
    names = ("loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "logits/rejected", "pairs")
    for step in (3, 4):
        for k in names:
            assert a[step][k] == b[step][k], (step, k, a[step][k], b[step][k])
    for step in (1, 2, 3, 4):
        assert a[step]["pairs"] > 8  # more pairs than rows: several a row
        for k in names:
            assert abs(a[step][k] - p[step][k]) <= 1e-6 * max(1.0, abs(a[step][k])), (step, k, a[step], p[step])
    ea, eb, ep = (by_step(r, "eval_loss") for r in (straight, split, pre))
    assert sorted(ea) == [2, 4] and ea[4]["eval_rewards/margins"] > ea[2]["eval_rewards/margins"] > 0
    for k in ("eval_loss", "eval_rewards/margins", "eval_logps/chosen", "eval_logits/chosen"):
        assert ea[4][k] == eb[4][k], (k, ea[4], eb[4])
        assert abs(ea[4][k] - ep[4][k]) <= 1e-6 * max(1.0, abs(ea[4][k])), (k, ea[4], ep[4])
