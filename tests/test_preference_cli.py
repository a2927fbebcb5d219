"""`fsdp-jax train objective=dpo ...`: bad preference input in one line (exit 2, nothing
written), and a DPO run that resumes exactly and exports as before."""

from __future__ import annotations

import json
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
    data = prefs(tmp_path / "p.jsonl", GOOD)
    common = ["--config", CONFIG, f"data.path={data}", "train.log_every=1", "train.checkpoint_every=2"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    assert call("train", *common, f"run_dir={straight}", "train.steps=4", "--no-progress", capsys=capsys)[0] == 0
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
    rc, _, err = call("export", split, "--hf", tmp_path / "hf", capsys=capsys)
    assert rc == 0, err[-2000:]
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "hf" / "model.safetensors").is_file()


@pytest.mark.slow
def test_precomputed_reference_equals_in_step_and_checks_the_data(tmp_path, capsys):
    data = prefs(tmp_path / "p.jsonl", GOOD)
    common = ["--config", CONFIG, f"data.path={data}", "train.log_every=1", "train.steps=3"]
    pre, inline = tmp_path / "pre", tmp_path / "inline"
    on = "preference.precompute_ref_log_probs=true"
    assert call("train", *common, f"run_dir={pre}", on, "--no-progress", capsys=capsys)[0] == 0
    assert call("train", *common, f"run_dir={inline}", "--no-progress", capsys=capsys)[0] == 0
    assert (pre / "ref_logps.npz").is_file() and not (inline / "ref_logps.npz").exists()

    def rows(run):
        return [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines() if "rewards/margins" in x]

    for a, b in zip(rows(pre), rows(inline)):
        for k in ("loss", "rewards/margins", "rewards/chosen", "logps/rejected"):
            assert abs(a[k] - b[k]) <= 1e-6, (a["step"], k, a[k], b[k])
    prefs(data, GOOD[:-1] + [{"prompt": "other ", "chosen": "a\n", "rejected": "b\n"}])  # the data changed
    rc, _, err = call("train", *common[:-1], "train.steps=4", f"run_dir={pre}", on, "--no-progress", capsys=capsys)
    one_line(rc, err, "ref_logps.npz", "does not match the dataset")
