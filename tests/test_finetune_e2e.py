"""End to end on CPU (docs/finetuning_data.md walk-through): a tiny chat set made here ->
prepare.py --pack with the golden Llama tokenizer and its chat template -> fine-tune
the tiny golden Llama -> example-level eval loss on the held-out examples falls, the
metrics log trained tokens, and the run resumes from its checkpoint."""

import json
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "tests" / "golden" / "chat"
GOLDEN = ROOT / "tests" / "golden" / "hf"
COLORS = ["red", "blue", "green", "black", "white", "brown", "pink", "gray"]
THINGS = ["sky", "grass", "snow", "coal", "cherry", "mouse", "bear", "rose", "sea", "leaf", "milk", "ash"]


def chat_set(path: Path, n: int = 240, seed: int = 0) -> Path:
    """Questions about made-up facts with a fixed answer form: learnable, so eval loss on
    unseen (held-out) conversations falls when only the answers are trained."""
    rng = np.random.default_rng(seed)
    path.parent.mkdir(parents=True, exist_ok=True)  # data/ does not exist in a fresh checkout
    with open(path, "w") as f:
        for i in range(n):
            thing, color = THINGS[i % len(THINGS)], COLORS[(i * 7) % len(COLORS)]
            msgs = [
                {"role": "user", "content": f"What color is the {thing}?"},
                {"role": "assistant", "content": f"The {thing} is {color}."},
            ]
            if rng.random() < 0.3:
                msgs.insert(0, {"role": "system", "content": "Answer briefly."})
            f.write(json.dumps({"messages": msgs}) + "\n")
    return path


def script(name):
    """The command module behind scripts/<name>.py (the script is a shim over its main)."""
    from fsdp_jax.app.cli.entry import SCRIPTS, command_module

    return command_module(SCRIPTS[name])


@pytest.mark.slow
def test_chat_finetune_end_to_end(tmp_path, capsys):
    from fsdp_jax.app.trainer.loop import train
    from fsdp_jax.app.trainer.setup import load_run_config

    src, d, run = chat_set(tmp_path / "chats.jsonl"), tmp_path / "sft", tmp_path / "run"
    assert (
        script("prepare").main(
            [
                "--out",
                str(d),
                str(src),
                "--pack",
                "64",
                "--no-progress",
                "--tokenizer",
                str(CHAT / "llama2"),
                "--val-fraction",
                "0.15",
                "--model",
                str(GOLDEN / "llama_gqa"),
            ]
        )
        == 0
    )
    assert "packing efficiency" in capsys.readouterr().out
    meta = json.loads((d / "meta.json").read_text())
    assert meta["kinds"] == {"chat": 240} and meta["val_rows"] > 0
    over = [
        f"data.path={d}",
        f"run_dir={run}",
        "data.seq_len=64",
        "train.steps=24",
        "train.log_every=4",
        "train.eval_every=12",
        "train.eval_batches=4",
        "train.checkpoint_every=12",
        "train.sample_tokens=8",
        "train.global_batch=8",
        "optimizer.lr=3e-3",
        f"init_from=hf:{GOLDEN / 'llama_gqa'}",
    ]
    s = train(load_run_config(ROOT / "configs" / "hf_tiny_finetune.yaml", over), progress=False)
    recs = [json.loads(x) for x in (run / "metrics.jsonl").read_text().splitlines()]
    train_recs = [r for r in recs if "loss" in r]
    vals = [r["val_loss"] for r in recs if "val_loss" in r]
    assert all(r["trained_tokens"] > 0 and r["trained_tokens_per_s"] > 0 for r in train_recs)
    assert train_recs[-1]["loss"] < train_recs[0]["loss"]
    assert len(vals) == 2 and vals[-1] < vals[0]
    print("val loss (held-out examples, per trained token):", vals, "sample:", s["sample"])
    # the trainer resumes a packed run from its checkpoint (batch order: tests/test_packing.py)
    s2 = train(
        load_run_config(ROOT / "configs" / "hf_tiny_finetune.yaml", over[:4] + ["train.steps=30"] + over[5:]),
        progress=False,
    )
    assert s2["final_step"] == 30
