"""One EvalHook and one SampleHook for every objective (fsdp_jax.app.trainer.measures): the
hook owns when and the bookkeeping, the objective what is measured. Stubs, no compile."""

import types

import pytest

from helpers import ROOT


class _Timer:
    def __init__(self):
        self.seen = []

    def switch(self, name):
        self.seen.append(name)


class _Log:
    def __init__(self):
        self.rows = []

    def write(self, rec):
        self.rows.append(rec)


class _Window:
    eval_s = 0.0

    def add_eval_time(self, s):
        self.eval_s += s


class _Bar:
    def __init__(self):
        self.lines = []

    def write(self, line):
        self.lines.append(line)


def _lp(done=4, last=8, stop=None):
    return types.SimpleNamespace(
        timer=_Timer(), log=_Log(), window=_Window(), bar=_Bar(), summary={}, done=done, last=last, stop=stop
    )


class _Eval:
    def __init__(self, ready=True):
        self.ready_, self.calls = ready, 0

    def ready(self, lp):
        return self.ready_

    def measure(self, lp):
        from fsdp_jax.app.trainer.measures import Measured

        self.calls += 1
        return Measured({"eval_x": 1.5, "eval_y": 2.0}, {"eval_x": 1.5}, f"step {lp.done}: eval_x 1.5")


def test_the_eval_hook_logs_what_the_objective_measured_and_times_it_out_of_throughput():
    from fsdp_jax.app.trainer.hooks import EvalHook

    lp, ev = _lp(), _Eval()
    EvalHook(every=2, evaluation=ev).after_step(lp)
    assert lp.log.rows == [{"step": 4, "eval_x": 1.5, "eval_y": 2.0}]
    assert lp.summary == {"eval_x": 1.5} and lp.bar.lines == ["step 4: eval_x 1.5"]
    assert lp.timer.seen == ["eval", "other"] and lp.window.eval_s > 0


@pytest.mark.parametrize(
    "every, lp, ready",
    [(2, _lp(done=3), True), (2, _lp(stop="signal"), True), (0, _lp(done=8), True), (2, _lp(), False)],
    ids=["not_due", "stopping", "eval_every_0", "nothing_to_evaluate"],
)
def test_the_eval_hook_measures_nothing_when_not_due_stopping_off_or_not_ready(every, lp, ready):
    from fsdp_jax.app.trainer.hooks import EvalHook

    ev = _Eval(ready)
    EvalHook(every=every, evaluation=ev).after_step(lp)
    assert ev.calls == 0 and lp.log.rows == [] and lp.timer.seen == []


def test_the_sample_hook_samples_once_at_the_end_unless_stopped_or_not_asked():
    from fsdp_jax.app.trainer.hooks import SampleHook

    sampler = types.SimpleNamespace(ready=lambda: True, sample=lambda lp: "text")
    lp = _lp(done=8)
    SampleHook(sampler=sampler).at_end(lp)
    assert lp.summary == {"sample": "text"} and lp.timer.seen == ["sample"]
    for hook_sampler, stop in ((sampler, "signal"), (types.SimpleNamespace(ready=lambda: False), None)):
        lp = _lp(done=8, stop=stop)
        SampleHook(sampler=hook_sampler).at_end(lp)
        assert lp.summary == {}


@pytest.mark.parametrize(
    "config, extra, evaluation, sampler",
    [
        ("tiny.yaml", [], "CorpusLoss", "TextSample"),
        ("dpo_tiny.yaml", [], "PairMetrics", "PairSample"),
        ("grpo_tiny.yaml", ["init_from=null", "train.sample_tokens=4"], "GrpoRewards", "GrpoSample"),
    ],
)
def test_each_objective_supplies_its_measure_and_sample(config, extra, evaluation, sampler):
    from fsdp_jax.app.config import load_config
    from fsdp_jax.app.trainer import measures

    cfg = load_config(ROOT / "configs" / config, extra)
    ev, sa = measures.for_run(cfg)
    assert (type(ev).__name__, type(sa).__name__) == (evaluation, sampler)
    assert sa.ready() is (cfg.train.sample_tokens > 0)
