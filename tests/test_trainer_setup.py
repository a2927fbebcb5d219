"""The trainer's structure: setup is a list of stages entered once each, in order; the
loop runs hooks each every N steps; faults come in as an argument, never from the
environment the loop runs in."""

import dataclasses
import types
from pathlib import Path

import pytest

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.trainer.faults import INJECT_NAN_ENV, Faults
from fsdp_jax.app.trainer.hooks import Hook
from fsdp_jax.app.trainer.loop import train
from fsdp_jax.app.trainer.setup import SETUP_STAGES, setup
from fsdp_jax.app.trainer.timing import INJECT_DATA_DELAY_ENV
from fsdp_jax.errors import ConfigError
from helpers import TINY_RUN_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]


def tiny(corpus, run_dir, *extra):
    return load_config(
        ROOT / "configs" / "tiny.yaml",
        TINY_RUN_OVERRIDES + ["train.checkpoint_every=0", f"data.path={corpus}", f"run_dir={run_dir}", *extra],
    )


def test_setup_enters_each_stage_once_in_order(corpus, tmp_path):
    seen = []
    run = setup(tiny(corpus, tmp_path / "run"), on_stage=seen.append)
    assert seen == ["validate", "data", "model", "mesh", "build", "state"]
    assert [n for n, _ in SETUP_STAGES] == seen
    assert run.start_step == 0 and int(run.state.step) == 0 and run.restored is None
    run.checkpointer.close()


@pytest.mark.parametrize(
    "every, stop, want",
    [
        (2, None, [2, 4, 5]),  # multiples of every, and the last step
        (0, None, [5]),  # 0: only the last step
        (3, 4, [3, 4]),  # and the step the run stops at
    ],
)
def test_a_hook_is_due_every_n_steps_the_last_and_when_stopping(every, stop, want):
    h = Hook(every=every)
    due = []
    for done in range(1, 6):
        lp = types.SimpleNamespace(done=done, last=5, stop="stop_after=4" if done == stop else None)
        if h.due(lp):
            due.append(done)
        if done == stop:
            break
    assert due == want


@dataclasses.dataclass
class Recorder(Hook):
    steps: list = dataclasses.field(default_factory=list)
    losses_read: list = dataclasses.field(default_factory=list)
    ended: list = dataclasses.field(default_factory=list)

    def after_step(self, lp):
        if self.due(lp):
            self.steps.append(lp.done)
            self.losses_read.append(not lp.pending)

    def at_end(self, lp):
        self.ended.append(lp.done)


@pytest.mark.slow
def test_faults_are_an_argument_and_hooks_run_every_n(corpus, tmp_path, monkeypatch, capsys):
    # values the commands' env hook would refuse: the loop must not read them
    monkeypatch.setenv(INJECT_NAN_ENV, "abc")
    monkeypatch.setenv(INJECT_DATA_DELAY_ENV, "-1")
    rec = Recorder(every=2)
    summary = train(
        tiny(corpus, tmp_path / "run", "train.steps=5", "train.max_nonfinite_steps=3"),
        progress=False,
        faults=Faults(nan_steps=frozenset({2})),
        hooks=[rec],
    )
    out = capsys.readouterr().out
    assert "warning: step 2: non-finite" in out and "step 3: non-finite" not in out
    assert rec.steps == [2, 4, 5] and rec.ended == [5]
    assert summary["final_step"] == 4  # step 2's update was skipped


@pytest.mark.parametrize(
    "env, key",
    [
        ({INJECT_NAN_ENV: "abc"}, INJECT_NAN_ENV),
        ({INJECT_NAN_ENV: "3,0"}, INJECT_NAN_ENV),
        ({INJECT_NAN_ENV: "-2"}, INJECT_NAN_ENV),
        ({INJECT_DATA_DELAY_ENV: "-3"}, INJECT_DATA_DELAY_ENV),
        ({INJECT_DATA_DELAY_ENV: "nan"}, INJECT_DATA_DELAY_ENV),
    ],
)
def test_the_commands_fault_variables_are_checked(env, key):
    with pytest.raises(ConfigError, match=rf"^{key}: .* is invalid"):
        Faults.from_env(env)


def test_the_commands_fault_variables_parse():
    assert Faults.from_env({}) == Faults()
    f = Faults.from_env({INJECT_NAN_ENV: "5, 6,7", INJECT_DATA_DELAY_ENV: "0.25"})
    assert f == Faults(nan_steps=frozenset({5, 6, 7}), data_delay_s=0.25)


def test_poison_marks_only_the_chosen_steps():
    import numpy as np

    f = Faults(nan_steps=frozenset({3}))
    rows = np.zeros((2, 5), np.int32)
    assert f.poison(2, rows, 100) is rows
    bad = f.poison(3, rows, 100)
    assert (bad[:, 0] == 100).all() and (rows == 0).all()  # a copy: the data is untouched
    packed = {"inputs": rows, "targets": rows}
    assert (f.poison(3, packed, 100)["inputs"][:, 0] == 100).all() and (rows == 0).all()
