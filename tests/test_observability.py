"""Observability: the step-time breakdown and goodput (fsdp_jax.app.trainer.timing), the
profiler window, device-memory warnings, the W&B sink, named scopes in the step,
and the time-breakdown plot."""

import gzip
import importlib.util
import json
import os
import re
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import fsdp_jax as fj
from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.config.policy_checks import parse_profile
from fsdp_jax.app.trainer import timing
from fsdp_jax.app.trainer.loop import train
from fsdp_jax.app.trainer.metrics import MetricsLog
from fsdp_jax.errors import ConfigError
from fsdp_jax.targets.perf import memory_excess
from helpers import TINY_MODEL_OVERRIDES, call, one_line, synthetic_corpus

ROOT = Path(__file__).resolve().parents[1]
TINY = [
    *TINY_MODEL_OVERRIDES,
    "train.eval_every=0",
    "train.sample_tokens=0",
    "train.checkpoint_every=0",
    "data.source=none",
    "optimizer.warmup_steps=2",
]
NAMED = [f"t_{k}_s" for k in timing.WINDOW if k != "other"]
HAVE_WANDB = importlib.util.find_spec("wandb") is not None


def tiny_cfg(*extra):
    return load_config(ROOT / "configs" / "tiny.yaml", TINY + list(extra))


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ----------------------------------------------------------------------------- timer


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_timer_charges_time_to_the_current_category_and_windows_add_up():
    clock = FakeClock()
    t = timing.StepTimer(clock=clock)
    clock.t += 1.0  # other 1
    t.switch("compile")
    clock.t += 5.0
    t.switch("data")
    clock.t += 0.5
    t.switch("device")
    clock.t += 2.0
    t.switch("other")
    clock.t += 0.25
    w = t.window()
    assert w == {
        "t_data_s": 0.5,
        "t_device_s": 2.0,
        "t_checkpoint_s": 0.0,
        "t_eval_s": 0.0,
        "t_compile_s": 5.0,
        "t_profile_s": 0.0,
        "t_log_s": 0.0,
        "t_other_s": 1.25,
        "t_wall_s": 8.75,
    }
    t.cut()
    t.switch("checkpoint")
    clock.t += 3.0
    t.switch("eval")
    clock.t += 1.0  # still running when the window is read
    w2 = t.window()
    assert w2["t_checkpoint_s"] == 3.0 and w2["t_eval_s"] == 1.0 and w2["t_compile_s"] == 0.0
    assert sum(w2[k] for k in w2 if k != "t_wall_s") == pytest.approx(w2["t_wall_s"]) == 4.0
    tot = t.totals()
    assert tot["device"] == 2.0 and tot["checkpoint"] == 3.0 and sum(tot.values()) == pytest.approx(12.75)
    with pytest.raises(ValueError, match="unknown timing category 'gpu'"):
        t.switch("gpu")


def test_goodput_names_the_largest_losses():
    totals = dict.fromkeys(timing.RUN, 0.0)
    totals.update(device=6.0, compile=2.0, data=1.0, eval=0.5, other=0.5)
    rec = timing.goodput(totals, setup_s=3.0, n_losses=2)
    assert rec["total_wall_s"] == 13.0 and rec["goodput"] == pytest.approx(6 / 13)
    assert rec["total_setup_s"] == 3.0
    assert [k for k, _, _ in rec["largest_losses"]] == ["setup", "compile"]
    line = timing.format_goodput(rec)
    assert line.startswith("goodput 46.2%") and "setup 3.0s (23.1%)" in line and "compile 2.0s" in line
    assert "data" not in line  # only the two largest
    assert timing.format_window({"t_wall_s": 2.0, "t_device_s": 1.5, "t_data_s": 0.5}) == "data 25% device 75%"


@pytest.mark.parametrize("text", ["abc", "-1", "nan", "inf", "1s"])
def test_bad_injected_data_delay_is_a_config_error(text):
    with pytest.raises(ConfigError, match=rf"{timing.INJECT_DATA_DELAY_ENV}: '{re.escape(text)}' is invalid"):
        timing.injected_data_delay({timing.INJECT_DATA_DELAY_ENV: text})
    assert timing.injected_data_delay({}) == 0.0
    assert timing.injected_data_delay({timing.INJECT_DATA_DELAY_ENV: "0.25"}) == 0.25


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize("text", ["4:2", "0:3", "-1:2", "a:b", "3", "2:", ":4", "2:4:6", "1.5:3"])
def test_bad_profile_ranges_are_rejected(text):
    with pytest.raises(ConfigError, match=r"^train\.profile: .* START:END"):
        tiny_cfg(f"train.profile={text}")


def test_profile_range_past_the_run_and_unquoted_yaml(tmp_path):
    with pytest.raises(ConfigError, match=r"train\.profile: '5:9' .*<= train\.steps=6"):
        tiny_cfg("train.steps=6", "train.profile=5:9")
    assert parse_profile("3:3") == (3, 3) and tiny_cfg("train.profile=2:4").train.profile == "2:4"
    y = tmp_path / "c.yaml"
    y.write_text("train:\n  profile: 2:4\n")  # YAML 1.1 reads this as 124
    with pytest.raises(ConfigError, match=r"train\.profile: 124 is not a string \(quote it"):
        load_config(y)


def test_wandb_enabled_without_the_package_is_one_clear_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "wandb" else real(n, *a))
    with pytest.raises(ConfigError, match=r"logging\.wandb: true, but the wandb package is not installed"):
        tiny_cfg("logging.wandb=true")
    assert tiny_cfg("logging.wandb=false").logging.wandb is False


def test_memory_excess_warns_only_above_ten_percent():
    assert memory_excess(110, 100) is None and memory_excess(50, 0) is None
    msg = memory_excess(120 * 2**20, 100 * 2**20)
    assert "120.0 MiB exceeds the compiled estimate 100.0 MiB by 20%" in msg


def test_window_record_carries_device_memory_and_warns_once(monkeypatch):
    from fsdp_jax.app.trainer import metrics as metrics_log

    stats = {"bytes_in_use": 90 * 2**20, "peak_bytes_in_use": 130 * 2**20, "bytes_limit": 2**34}
    monkeypatch.setattr(metrics_log, "device_memory", lambda: stats)  # what a GPU reports
    warnings, clock = [], FakeClock()
    timer = timing.StepTimer(clock=clock)
    w = metrics_log.LogWindow(
        0,
        schedule=lambda i: 1e-3,
        tokens_per_step=100,
        flops_per_token=6.0,
        peak_flops=None,
        n_devices=8,
        compiled_peak_bytes=100 * 2**20,
        timer=timer,
        warn=warnings.append,
    )
    for step in (1, 2):
        timer.switch("device")
        clock.t += 0.5
        timer.switch("other")
        w.add(2.0, 1.0)
        rec = w.record(step)
        w.reset(step)
        assert rec["bytes_in_use"] == 90 * 2**20 and rec["peak_bytes_in_use"] == 130 * 2**20
        assert rec["t_device_s"] == rec["t_wall_s"] == rec["step_time_s"] == 0.5
        assert rec["tokens_per_s"] == 200.0
    assert len(warnings) == 1 and "exceeds the compiled estimate 100.0 MiB by 30%" in warnings[0]


# ----------------------------------------------------------------------------- named scopes


def test_train_step_has_forward_backward_and_optimizer_scopes():
    def init(rng):
        return {"w1": jax.random.normal(rng, (64, 256)) * 0.05, "w2": jnp.zeros((256, 64))}

    def loss_fn(p, batch):
        return jnp.mean((jnp.tanh(batch @ p["w1"]) @ p["w2"] - batch) ** 2)

    opt = optax.adamw(1e-3)
    state, plan = fj.init_train_state(init, opt, fj.make_mesh(fsdp=8), jax.random.key(0))
    hlo = fj.make_train_step(loss_fn, opt, plan).lower(state, jnp.ones((16, 64))).compile().as_text()
    names = set(re.findall(r'op_name="([^"]*)"', hlo))
    assert any("/jvp(forward)/" in n and n.endswith("dot_general") for n in names)
    assert any("/transpose(jvp(forward))/" in n for n in names)  # the backward pass
    assert any("/optimizer/" in n for n in names)


# ----------------------------------------------------------------------------- W&B


def wandb_history(run_dir: Path, timeout_s: float = 60.0) -> dict[int, dict]:
    """{step: history row} read back from the offline run's .wandb file: a LevelDB-style
    log (32 KiB blocks of records with a 7-byte header: crc, length, type) of
    wandb's Record protobufs after a 7-byte ':W&B' file header. wandb's service may
    still be writing it after `finish()` returns: wait for the run's exit record."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    deadline = time.monotonic() + timeout_s
    while True:
        data, pos, block, buf, rows, done = path.read_bytes(), 7, 32768, b"", {}, False
        assert data[:4] == b":W&B"
        while pos + 7 <= len(data):
            if block - pos % block < 7:  # block trailer padding
                pos += block - pos % block
                continue
            _, n, kind = struct.unpack("<IHB", data[pos : pos + 7])
            buf, pos = buf + data[pos + 7 : pos + 7 + n], pos + 7 + n
            if kind in (1, 4):  # FULL or LAST
                rec = pb.Record()
                rec.ParseFromString(buf)
                buf, what = b"", rec.WhichOneof("record_type")
                done |= what == "exit"
                if what == "history":
                    row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in rec.history.item}
                    rows[rec.history.step.num] = {k: v for k, v in row.items() if not k.startswith("_")}
        if done or time.monotonic() > deadline:
            assert done, f"{path}: no exit record after {timeout_s} s"
            return rows
        time.sleep(0.2)


def merged_by_step(records: list[dict]) -> dict[int, dict]:
    out: dict[int, dict] = {}
    for r in records:
        out.setdefault(r["step"], {}).update({k: v for k, v in r.items() if k != "step"})
    return out


@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (pip install -e .[test])")
def test_wandb_sink_logs_the_same_records(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    log = MetricsLog(tmp_path, True, False, wandb={"project": "t", "name": "n", "config": {"a": 1}})
    recs = [
        {"step": 1, "loss": 2.5, "mfu": None, "t_wall_s": 0.5},
        {"step": 1, "val_loss": 2.25},
        {"step": 3, "loss": 2.0, "mfu": None, "t_wall_s": 0.25},
    ]
    for r in recs:
        log.write(r)
    log.close()
    assert read_jsonl(tmp_path / "metrics.jsonl") == recs
    assert wandb_history(tmp_path) == merged_by_step(recs)


# ----------------------------------------------------------------------------- end to end

DELAY_S = 0.2


@pytest.fixture(scope="module")
def observed_run(tmp_path_factory):
    """One tiny run with every observability feature on: an injected data delay, a
    profile of steps 2-4, and W&B offline (when installed)."""
    tmp = tmp_path_factory.mktemp("obs")
    corpus = synthetic_corpus(tmp / "corpus")
    run_dir = tmp / "run"
    env = {timing.INJECT_DATA_DELAY_ENV: str(DELAY_S), "WANDB_MODE": "offline", "WANDB_SILENT": "true"}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        cfg = tiny_cfg(
            f"data.path={corpus}",
            f"run_dir={run_dir}",
            "train.steps=8",
            "train.log_every=4",
            "train.checkpoint_every=4",
            "train.profile=2:4",
            f"logging.wandb={str(HAVE_WANDB).lower()}",
        )
        t0 = time.perf_counter()
        summary = train(cfg, progress=False)
        wall = time.perf_counter() - t0
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
    return summary, wall, run_dir, read_jsonl(run_dir / "metrics.jsonl")


@pytest.mark.slow
def test_injected_data_delay_shows_in_the_data_column_and_columns_add_up(observed_run):
    _, _, _, records = observed_run
    windows = [r for r in records if "loss" in r]
    assert [r["step"] for r in windows] == [4, 8]
    # (what the load of the machine cannot change; where the delay goes, against what was
    # injected on a virtual clock: tests/test_timing_injected.py)
    for r in windows:
        assert r["t_data_s"] >= 4 * DELAY_S  # 4 steps per window, each delayed
        named = sum(r[k] for k in NAMED)
        assert named + r["t_other_s"] == pytest.approx(r["t_wall_s"])
        # step_time_s leaves out compile and profiler start/stop, so throughput is the loop's
        assert r["step_time_s"] * 4 == pytest.approx(
            r["t_wall_s"] - r["t_compile_s"] - r["t_profile_s"] - r["t_eval_s"], rel=1e-6
        )
    assert windows[0]["t_compile_s"] > 0 and windows[1]["t_compile_s"] == 0


@pytest.mark.slow
def test_goodput_record_covers_the_run(observed_run):
    summary, wall, _, records = observed_run
    good = records[-1]
    assert "goodput" in good and good["step"] == 8
    assert good["goodput"] == pytest.approx(good["total_device_s"] / good["total_wall_s"])
    parts = sum(good[f"total_{k}_s"] for k in timing.RUN)
    assert parts == pytest.approx(good["total_wall_s"])
    # setup + loop: the whole train() call but its last checkpointer.close()
    assert 8 * DELAY_S <= good["total_wall_s"] <= wall
    windows = [r for r in records if "loss" in r]
    assert good["total_data_s"] >= sum(r["t_data_s"] for r in windows) - 1e-9 >= 8 * DELAY_S
    assert summary["goodput"]["largest_losses"][0][0] in timing.RUN


@pytest.mark.slow
def test_profile_window_writes_a_trace(observed_run, capsys):
    _, _, run_dir, records = observed_run
    (xplane,) = run_dir.glob("profile/plugins/profile/*/*.xplane.pb")
    assert xplane.stat().st_size > 0
    (trace,) = run_dir.glob("profile/plugins/profile/*/*.trace.json.gz")
    events = json.load(gzip.open(trace))["traceEvents"]
    assert any(e.get("ph") == "X" for e in events)
    assert records[0]["t_profile_s"] > 0  # started and stopped inside the first window (steps 1-4)


@pytest.mark.slow
@pytest.mark.skipif(not HAVE_WANDB, reason="wandb is not installed (pip install -e .[test])")
def test_wandb_offline_history_equals_metrics_jsonl(observed_run):
    _, _, run_dir, records = observed_run
    assert wandb_history(run_dir) == merged_by_step(records)


@pytest.mark.parametrize(
    "args,key",
    [
        (["train.profile=4:2"], "train.profile"),
        (["train.profile=0:1"], "train.profile"),
        ([], timing.INJECT_DATA_DELAY_ENV),
    ],
)
def test_cli_bad_profile_or_delay_exits_2_writing_nothing(tmp_path, args, key, capsys):
    corpus = synthetic_corpus(tmp_path / "corpus")
    env = {key: "-3"} if key == timing.INJECT_DATA_DELAY_ENV else {}
    rc, _, err = call(
        "train",
        "--config",
        "configs/tiny.yaml",
        "--no-progress",
        *TINY,
        f"data.path={corpus}",
        f"run_dir={tmp_path / 'run'}",
        *args,
        capsys=capsys,
        env=env,
    )
    assert one_line(rc, err).startswith(f"error: {key}: ")
    assert not (tmp_path / "run").exists()


# ----------------------------------------------------------------------------- plot


def test_plot_shows_the_breakdown_and_goodput(tmp_path):
    from fsdp_jax.app.cli import plot as plot_command
    from fsdp_jax.app.trainer import plot as plot_metrics

    recs = [
        {
            "step": s,
            "loss": 3.0 - s / 10,
            "tokens_per_s": 100.0,
            "t_data_s": 0.1,
            "t_device_s": 0.8,
            "t_checkpoint_s": 0.0,
            "t_eval_s": 0.05,
            "t_compile_s": 2.0 if s == 2 else 0.0,
            "t_profile_s": 0.0,
            "t_other_s": 0.05,
            "t_wall_s": 1.0 + (2.0 if s == 2 else 0.0),
        }
        for s in (2, 4)
    ]
    recs.append(
        {
            "step": 4,
            "goodput": 0.4,
            "total_wall_s": 4.0,
            "total_device_s": 1.6,
            **{f"total_{k}_s": 0.4 for k in timing.RUN if k != "device"},
        }
    )
    fractions = plot_metrics.time_fractions([r for r in recs if "loss" in r])
    for i in range(2):
        assert sum(f[i] for f in fractions.values()) == pytest.approx(1.0)
    assert fractions["compile"][0] == pytest.approx(2 / 3) and fractions["device"][1] == pytest.approx(0.8)
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert plot_command.main([str(tmp_path)]) == 0
    assert (tmp_path / "metrics.png").stat().st_size > 0
