"""`fsdp-jax train objective=grpo ...`: bad GRPO input in one line (exit 2, nothing written),
a run whose metrics carry TRL's GRPO names and that resumes exactly (sampler RNG included),
and a reward that fails mid-run: exit 1, named, the last finished step checkpointed."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from helpers import ROOT, call, one_line

CONFIG = ROOT / "configs" / "grpo_tiny.yaml"
REWARDS = """
CALLS = [0]

def digits(prompts, completions, answer, **kw):
    return [float(sum(ch.isdigit() for ch in c)) / 3 for c in completions]

def wrong_length(prompts, completions, **kw):
    return [1.0] * (len(completions) + 1)

def third_call_raises(prompts, completions, **kw):
    CALLS[0] += 1
    if CALLS[0] == 3:
        raise RuntimeError("the grader is down")
    return [0.5] * len(completions)
"""
# a fresh tiny model (no SFT), 4 prompts x 4 completions per step
BASE = [
    "init_from=null",
    "grpo.num_generations=4",
    "train.global_batch=16",
    "train.log_every=1",
    "train.checkpoint_every=2",
]


def setup_dir(tmp_path: Path, n: int = 24, prompt: str = "{i}+{j}=") -> tuple[Path, dict]:
    rows = [{"prompt": prompt.format(i=i % 7, j=i % 5), "answer": str(i % 7 + i % 5)} for i in range(n)]
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "my_rewards.py").write_text(REWARDS)
    env = {"PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")])}
    return data, env


def train(tmp_path, capsys, env, *extra):
    return call("train", "--config", CONFIG, *BASE, *extra, "--no-progress", capsys=capsys, env=env)


@pytest.mark.parametrize(
    "extra, words",
    [
        (["grpo.rewards=no_such_module:f"], ["grpo.rewards", "no_such_module:f", "cannot be loaded"]),
        (["grpo.rewards=my_rewards:nope"], ["my_rewards:nope", "has no function 'nope'"]),
        (["grpo.rewards=nonsense"], ["grpo.rewards", "built-in"]),
        (["grpo.num_generations=1"], ["grpo.num_generations", ">= 2"]),
        (["grpo.max_prompt_len=3"], ["prompts.jsonl:", "longer than grpo.max_prompt_len=3"]),
        (["grpo.max_new_tokens=30"], ["grpo.max_new_tokens", "model.max_seq_len=32"]),
        (["train.global_batch=24", "grpo.num_generations=16"], ["train.global_batch", "num_generations=16"]),
        (["grpo.reward_weights=1 2"], ["grpo.reward_weights", "2 finite weights for 1 rewards"]),
        (["grpo.loss_type=ppo"], ["grpo.loss_type", "dapo"]),
        (["grpo.stop_tokens=ten"], ["grpo.stop_tokens", "integers"]),
        (["offload=optimizer"], ["offload", "'optimizer'", "objective grpo does not support"]),
        (["grpo.eval_path=nowhere.jsonl"], ["grpo.eval_path", "nowhere.jsonl", "no such file"]),
        (["mesh.context=2", "data.seq_len=16"], ["mesh.context", "objective grpo does not support"]),
    ],
)
def test_bad_grpo_input_one_line(tmp_path, capsys, extra, words):
    data, env = setup_dir(tmp_path)
    run = tmp_path / "run"
    rc, _, err = train(tmp_path, capsys, env, f"data.path={data}", f"run_dir={run}", *extra)
    one_line(rc, err, *words)
    assert not run.exists()


def stop_at_2(env: dict, overrides: list[str], n: int = 2) -> None:
    """The run of `overrides`, stopped after step `n` (checkpointed) as a preemption would."""
    from fsdp_jax.app.trainer.loop import train as train_fn
    from fsdp_jax.app.trainer.setup import load_run_config

    os.environ["PYTHONPATH"], old = env["PYTHONPATH"], os.environ.get("PYTHONPATH")
    try:
        cfg = load_run_config(CONFIG, [*BASE, *overrides])
        assert train_fn(cfg, progress=False, stop_after=n)["preempted"] == f"stop_after={n}"
    finally:
        os.environ.pop("PYTHONPATH") if old is None else os.environ.update(PYTHONPATH=old)


def saved_extras(step_dir: Path) -> dict:
    """The JSON extras of a checkpoint step (the file Orbax wrote under extras/)."""
    for f in sorted((step_dir / "extras").rglob("*")):
        if f.is_file():
            try:
                d = json.loads(f.read_text())
            except ValueError:
                continue
            if isinstance(d, dict) and "data" in d:
                return d
    raise AssertionError(f"no extras under {step_dir}")


def eval_rows(run: Path) -> dict:
    return {
        r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "eval_reward" in r
    }


def rows(run: Path) -> dict:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()) if "loss" in r}


@pytest.mark.slow
def test_grpo_run_logs_trl_metrics_and_resumes_exactly(tmp_path, capsys):
    data, env = setup_dir(tmp_path)
    common = [f"data.path={data}", "grpo.rewards=my_rewards:digits answer_match", "grpo.reward_weights=1 0.5"]
    common += ["grpo.beta=0.04", "grpo.num_iterations=2", "grpo.top_k=50", "grpo.temperature=1.2"]
    (tmp_path / "eval").mkdir()
    evals, _ = setup_dir(tmp_path / "eval", n=8, prompt="{j}+{i}=")  # held-out prompts
    common += [f"grpo.eval_path={evals}", "train.eval_every=2", "train.eval_batches=1", "train.sample_tokens=1"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    rc, out, err = train(tmp_path, capsys, env, *common, f"run_dir={straight}", "train.steps=4")
    assert rc == 0, err[-2000:]
    assert "sample:\n0+0=" in out, out[-2000:]  # the first eval prompt and its completion
    stop_at_2(env, [*common, f"run_dir={split}", "train.steps=4"])
    rc, out, err = train(tmp_path, capsys, env, *common, f"run_dir={split}", "train.steps=4")
    assert rc == 0 and "resuming from checkpoint step 2" in out, err[-2000:]
    a, b = rows(straight), rows(split)
    names = ["reward", "reward_std", "rewards/digits/mean", "rewards/digits/std", "rewards/answer_match/mean"]
    names += ["kl", "entropy", "clip_ratio/region_mean", "clip_ratio/low_mean", "completions/mean_length"]
    for step in (1, 3):  # generation steps (num_iterations 2): rewards logged
        assert set(names) <= set(a[step]), set(names) - set(a[step])
    for step in (3, 4):
        for k in ("loss", "grad_norm", "kl", "entropy"):
            assert a[step][k] == b[step][k], (step, k, a[step][k], b[step][k])
    assert a[3]["reward"] == b[3]["reward"] and a[3]["completions/mean_length"] == b[3]["completions/mean_length"]
    ea, eb = eval_rows(straight), eval_rows(split)
    assert sorted(ea) == [2, 4] and sorted(eb) == [4]  # no eval when stopping (the split run at step 2)
    eval_names = ["eval_reward", "eval_rewards/digits/mean", "eval_rewards/answer_match/mean"]
    assert set(eval_names + ["eval_completions/mean_length"]) <= set(ea[2]), sorted(ea[2])
    assert ea[4] == eb[4]  # the same params and eval keys: the same eval after a resume
    assert a[1]["kl"] == 0.0 and a[3]["kl"] > 0  # policy == reference until the first update (lr 0 at step 1)
    assert 0 <= a[1]["rewards/answer_match/mean"] <= 1 and a[1]["reward_std"] > 0
    rc, _, err = call("export", split, "--hf", tmp_path / "hf", capsys=capsys)  # export as before
    assert rc == 0 and (tmp_path / "hf" / "model.safetensors").is_file(), err[-2000:]


@pytest.mark.slow
def test_resume_inside_a_generation_is_exact(tmp_path, capsys):
    """Stopped after step 2 of a generation's 3 optimizer steps: the resumed run trains step 3
    on the batch the first policy sampled (saved in the checkpoint's extras: that policy is
    gone) and samples step 4's from the params after step 3, bit for bit as the straight run."""
    data, env = setup_dir(tmp_path)
    common = [f"data.path={data}", "grpo.num_iterations=3", "grpo.beta=0.04", "train.steps=4"]
    common += ["grpo.rewards=my_rewards:digits"]  # rewards that differ within a group: the policy moves
    common += ["optimizer.lr=3e-3", "optimizer.warmup_steps=0", "train.checkpoint_every=10"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    rc, _, err = train(tmp_path, capsys, env, *common, f"run_dir={straight}")
    assert rc == 0, err[-2000:]
    stop_at_2(env, [*common, f"run_dir={split}"])
    extras = saved_extras(split / "checkpoints" / "2")
    assert extras["data"]["generation"]["index"] == 0, list(extras["data"])
    rc, out, err = train(tmp_path, capsys, env, *common, f"run_dir={split}")
    assert rc == 0 and "resuming from checkpoint step 2" in out, err[-2000:]
    a, b = rows(straight), rows(split)
    for step in (3, 4):
        for k in ("loss", "grad_norm", "kl", "clip_ratio/region_mean"):
            assert a[step][k] == b[step][k], (step, k, a[step][k], b[step][k])
    assert a[4]["reward"] == b[4]["reward"] and a[4]["completions/mean_length"] == b[4]["completions/mean_length"]
    assert a[3]["clip_ratio/region_mean"] > 0 or a[3]["kl"] > 0  # step 3 trains off-policy: the batch matters


@pytest.mark.slow
def test_failing_reward_stops_with_the_last_step_saved(tmp_path, capsys):
    data, env = setup_dir(tmp_path)
    run = tmp_path / "run"
    args = [f"data.path={data}", f"run_dir={run}", "train.steps=4", "train.checkpoint_every=10"]
    rc, _, err = train(tmp_path, capsys, env, *args, "grpo.rewards=my_rewards:third_call_raises")
    line = one_line(rc, err, "my_rewards:third_call_raises", "RuntimeError: the grader is down", code=1)
    assert "my_rewards.py:" in line
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["2"]  # step 3 never ran
    rc, _, err = train(tmp_path, capsys, env, *args, "grpo.rewards=my_rewards:wrong_length", f"run_dir={run}2")
    one_line(rc, err, "my_rewards:wrong_length", "returned 17 values for 16 completions")


@pytest.mark.slow
def test_lora_grpo_reference_is_the_base_and_resumes_exactly(tmp_path, capsys):
    data, env = setup_dir(tmp_path)
    common = [f"data.path={data}", "lora.rank=4", "grpo.beta=0.04", "grpo.rewards=my_rewards:digits"]
    common += ["optimizer.lr=3e-3", "train.steps=3"]
    straight, split = tmp_path / "straight", tmp_path / "split"
    rc, _, err = train(tmp_path, capsys, env, *common, f"run_dir={straight}")
    assert rc == 0, err[-2000:]
    stop_at_2(env, [*common, f"run_dir={split}"])
    rc, out, err = train(tmp_path, capsys, env, *common, f"run_dir={split}")
    assert rc == 0 and "resuming from checkpoint step 2" in out, err[-2000:]
    a, b = rows(straight), rows(split)
    assert a[1]["kl"] == 0.0 and a[3]["kl"] > 0  # adapters start at B = 0: the policy is the base
    for k in ("loss", "grad_norm", "kl", "reward"):
        assert a[3][k] == b[3][k], (k, a[3][k], b[3][k])
