"""Where the trainer charges its time, checked against what was injected, on a clock that
does not depend on the machine being idle: the injected data delay (1000 s per step) advances
a virtual clock instead of sleeping, so a window's columns hold the delay exactly where it was
injected and nothing the machine's load does (seconds at most) comes near it. Real time still
runs: the columns still add up to the window's wall time."""

import time
import types

import pytest
from test_observability import NAMED, read_jsonl, tiny_cfg

from fsdp_jax.app.trainer import loop, timing
from fsdp_jax.app.trainer.faults import Faults

DELAY_S = 1000.0  # virtual: larger than any real time this run can take
STEPS_PER_WINDOW = 4


@pytest.fixture(scope="module")
def virtual_run(tmp_path_factory, corpus):
    mp = pytest.MonkeyPatch()
    offset = [0.0]

    def clock() -> float:
        return time.perf_counter() + offset[0]

    def sleep(s: float) -> None:  # the injected delay: virtual time passes, no real time
        offset[0] += s

    mp.setattr(loop, "time", types.SimpleNamespace(perf_counter=clock, sleep=sleep))
    mp.setattr(loop, "StepTimer", lambda category="other": timing.StepTimer(category, clock=clock))
    run_dir = tmp_path_factory.mktemp("virtual") / "run"
    try:
        cfg = tiny_cfg(f"data.path={corpus}", f"run_dir={run_dir}", "train.steps=8", "train.log_every=4")
        t0 = clock()
        loop.train(cfg, progress=False, faults=Faults(data_delay_s=DELAY_S))
        wall = clock() - t0
    finally:
        mp.undo()
    return wall, read_jsonl(run_dir / "metrics.jsonl")


def test_the_injected_delay_is_charged_to_data_and_nowhere_else(virtual_run):
    _, records = virtual_run
    windows = [r for r in records if "loss" in r]
    assert [r["step"] for r in windows] == [4, 8]
    injected = STEPS_PER_WINDOW * DELAY_S
    for r in windows:
        real = r["t_wall_s"] - injected  # the window's real time, whatever the machine's load
        assert 0 < real < DELAY_S, r
        assert injected <= r["t_data_s"] <= injected + real  # the delay, plus the real fetches
        for k in NAMED + ["t_other_s"]:
            if k != "t_data_s":
                assert r[k] <= real, (k, r)  # no part of the delay leaked into another column
        assert sum(r[k] for k in NAMED) + r["t_other_s"] == pytest.approx(r["t_wall_s"])
        assert r["step_time_s"] * STEPS_PER_WINDOW == pytest.approx(
            r["t_wall_s"] - r["t_compile_s"] - r["t_profile_s"] - r["t_eval_s"], rel=1e-9
        )


def test_goodput_counts_the_delay_as_lost_time(virtual_run):
    wall, records = virtual_run
    good = records[-1]
    injected = 8 * DELAY_S
    assert injected <= good["total_data_s"] <= injected + (wall - injected)
    assert injected <= good["total_wall_s"] <= wall  # setup + loop: inside the train() call
    assert sum(good[f"total_{k}_s"] for k in timing.RUN) == pytest.approx(good["total_wall_s"])
    assert good["goodput"] <= (wall - injected) / good["total_wall_s"]  # device time is real time
