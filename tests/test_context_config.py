"""`mesh.context` in the run config: bad values are one line and exit 2 with nothing
written (seq_len not divisible by 2 x context, mesh sizes that do not multiply to the
device count, an attention kernel the ring cannot run), and a good one trains."""

import json

from helpers import TINY_RUN_OVERRIDES, call, one_line

TINY = ["--config", "configs/tiny.yaml"]


def test_bad_context_inputs_one_line_exit_2_nothing_written(tmp_path, capsys):
    cases = [  # (overrides, words the one line must hold)
        (
            ["mesh.context=4", "mesh.fsdp=2", "data.seq_len=36", "model.max_seq_len=36"],
            ["data.seq_len", "2 x mesh.context = 8"],
        ),
        (["mesh.context=3"], ["mesh", "context=3", "8 devices"]),
        (["mesh.context=2", "mesh.fsdp=2"], ["mesh", "multiply to 4", "8 devices"]),
        (["mesh.context=2", "model.attention=cudnn"], ["model.attention", "cudnn", "context parallelism"]),
        (["model.context_kv_pass=telepathy"], ["model.context_kv_pass", "ring"]),
    ]
    for extra, words in cases:
        run_dir = tmp_path / "run"
        rc, _, err = call(
            "train", *TINY, *TINY_RUN_OVERRIDES, f"run_dir={run_dir}", "train.steps=1", *extra, capsys=capsys
        )
        one_line(rc, err, *words)
        assert not run_dir.exists(), extra


def test_plan_rejects_the_same_config_with_one_line(capsys):
    rc, _, err = call(
        "plan", *TINY, "--devices", "8", *TINY_RUN_OVERRIDES, "mesh.context=4", "data.seq_len=36", capsys=capsys
    )
    one_line(rc, err, "data.seq_len")


def test_train_with_context_2_runs_and_logs(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = [*TINY_RUN_OVERRIDES, f"data.path={corpus}", f"run_dir={run_dir}", "train.steps=2"]
    rc, _, err = call("train", *TINY, *args, "mesh.context=2", capsys=capsys)
    assert rc == 0, err[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2
    assert "context: 2" in (run_dir / "config.yaml").read_text()
