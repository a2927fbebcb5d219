"""The trainer end to end on a tiny model: strategies agree, a golden loss curve,
metrics/config files, and the command line's exit codes."""

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.trainer.loop import train
from helpers import TINY_RUN_OVERRIDES, call, one_line

# end-to-end training runs and subprocesses: the whole file is outside the fast subset
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = Path(__file__).parent / "golden" / "tiny_losses.json"
TINY = TINY_RUN_OVERRIDES + ["train.checkpoint_every=0"]


def losses_of(run_dir: Path) -> list[float]:
    return [r["loss"] for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines()) if "loss" in r]


def run_tiny(corpus, run_dir, *extra, steps=3):
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        TINY + [f"data.path={corpus}", f"run_dir={run_dir}", f"train.steps={steps}", *extra],
    )
    return train(cfg, progress=False)


def test_full_shard_and_no_shard_first_losses_agree(corpus, tmp_path):
    run_tiny(corpus, tmp_path / "fs", "mesh.strategy=full_shard")
    run_tiny(corpus, tmp_path / "ns", "mesh.strategy=no_shard")
    a, b = losses_of(tmp_path / "fs"), losses_of(tmp_path / "ns")
    assert len(a) == 3
    np.testing.assert_allclose(a, b, rtol=1e-5)


def test_golden_loss_curve(corpus, tmp_path):
    """Silent numerical changes show here. Regenerate only for an intended change:
    FSDP_JAX_UPDATE_GOLDEN=1 pytest tests/test_trainer.py -k golden"""
    run_tiny(corpus, tmp_path / "g", steps=12)
    losses = losses_of(tmp_path / "g")
    if os.environ.get("FSDP_JAX_UPDATE_GOLDEN"):
        GOLDEN.write_text(json.dumps({"overrides": TINY, "steps": 12, "losses": losses}, indent=1) + "\n")
    golden = json.loads(GOLDEN.read_text())["losses"]
    np.testing.assert_allclose(losses, golden, rtol=2e-4)
    assert losses[-1] < losses[0] - 0.5  # and it learns


def test_run_dir_holds_config_and_metrics(corpus, tmp_path, capsys):
    summary = run_tiny(
        corpus,
        tmp_path / "r",
        "train.sample_tokens=8",
        "train.eval_every=2",
        "train.eval_batches=2",
        "train.tensorboard=true",
        steps=2,
    )
    run_dir = tmp_path / "r"
    resolved = load_config(run_dir / "config.yaml")
    assert resolved.train.steps == 2 and resolved.data.path == str(corpus)
    records = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines()]
    step_rec = [r for r in records if "loss" in r][0]
    for key in ("step", "loss", "lr", "grad_norm", "step_time_s", "tokens_per_s", "mfu", "compiled_peak_bytes"):
        assert key in step_rec
    assert any("val_loss" in r for r in records)
    assert isinstance(summary["sample"], str) and len(summary["sample"]) > 0
    events = list((run_dir / "tb").glob("events.out.tfevents.*"))
    assert events and events[0].stat().st_size > 0
    # scripts/plot.py draws the run's metrics (train and eval rows)
    rc, out, err = call("plot", run_dir, capsys=capsys)
    assert rc == 0, err
    assert (run_dir / "metrics.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def cli(*args, timeout=240):
    env = dict(os.environ, FSDP_JAX_CPU_DEVICES="8")
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "train.py"), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        cwd=ROOT,
    )


# The messages themselves are pinned in process (tests/test_config.py); these check the
# command line's contract once per stage: parsing the config, and checks that need the
# devices or the data.
@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.stepz=3"], ["train.stepz", "did you mean", "train.steps"]),
        (["train.global_batch=12"], ["train.global_batch", "12", "8"]),
        (["data.source=none", "data.path=/nonexistent/corpus"], ["data.path", "/nonexistent/corpus"]),
    ],
)
def test_bad_input_exits_2_with_one_line(overrides, words, capsys):
    rc, _, err = call("train", "--config", "configs/tiny.yaml", "--no-progress", *overrides, capsys=capsys)
    one_line(rc, err, *words)


def test_missing_config_file_exits_2():
    """The script's own entry point (`python scripts/train.py`), once: one line, exit 2."""
    r = cli("--config", "configs/nope.yaml")
    one_line(r.returncode, r.stderr, "nope.yaml")
