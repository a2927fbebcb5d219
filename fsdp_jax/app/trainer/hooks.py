"""What the training loop does besides stepping: hooks, each due every N steps.

The loop (`fsdp_jax.app.trainer.loop`) steps the model and hands each hook the `LoopState`
after every step, in order: profile, non-finite guard, log (`every=train.log_every`),
eval (`every=train.eval_every`), checkpoint (`every=train.checkpoint_every`); at the
end, after the last step, `at_end` runs in the same order (sampling is a hook that
only acts there). A hook is due at multiples of `every`, at the last step and when
the run is stopping (`Hook.due`); each hook narrows that to what it needs. The eval
and sample hooks are the same for every objective: what they measure and log comes from
the objective (`fsdp_jax.app.trainer.measures`).
"""

from __future__ import annotations

import dataclasses
import time
from collections import deque
from typing import Any

from fsdp_jax.app.config.parse import config_to_dict
from fsdp_jax.app.trainer import measures, nvme_run
from fsdp_jax.app.trainer.lora_state import saved_state
from fsdp_jax.app.trainer.metrics import LogWindow, MetricsLog
from fsdp_jax.app.trainer.setup import rng_to_json
from fsdp_jax.app.trainer.timing import ProfileWindow, StepTimer, format_window
from fsdp_jax.errors import TrainingDiverged


@dataclasses.dataclass
class LoopState:
    """What the loop and its hooks share during a run."""

    run: Any  # fsdp_jax.app.trainer.setup.Run
    cfg: Any
    timer: StepTimer
    log: MetricsLog
    batches: Any  # the train iterator (get_state / set_state)
    val: list  # validation batches (empty: no eval)
    window: LogWindow
    state: Any  # the TrainState being trained
    last: int  # train.steps
    summary: dict
    bar: Any = None  # tqdm bar on the main process, or None
    done: int = 0  # the last step done
    stop: str | None = None  # why the run stops early (a signal, stop_after), else None
    pending: deque = dataclasses.field(default_factory=deque)  # (step, metrics) not yet read
    streak: list = dataclasses.field(default_factory=list)  # the current run of skipped steps


@dataclasses.dataclass
class Hook:
    every: int = 0  # 0: only at the last step and when stopping

    def due(self, lp: LoopState) -> bool:
        return lp.done == lp.last or lp.stop is not None or bool(self.every and lp.done % self.every == 0)

    def needs_metrics(self, lp: LoopState) -> bool:
        """Whether this step's metrics must be read (the step finished) before `after_step`."""
        return False

    def before_step(self, lp: LoopState) -> None: ...

    def after_step(self, lp: LoopState) -> None: ...

    def at_end(self, lp: LoopState) -> None: ...


@dataclasses.dataclass
class ProfileHook(Hook):
    """A jax.profiler trace over the configured steps (`fsdp_jax.app.trainer.timing.ProfileWindow`)."""

    profiler: ProfileWindow | None = None

    def before_step(self, lp):
        self.profiler.step_begin(lp.done)

    def after_step(self, lp):
        self.profiler.step_end(lp.done, lp.pending)

    def at_end(self, lp):
        self.profiler.close(lp.done, lp.pending)


@dataclasses.dataclass
class NonFiniteGuard(Hook):
    """Raises TrainingDiverged after `limit` skipped (non-finite) steps in a row; the
    newest checkpoint is the last good update."""

    limit: int = 1

    def after_step(self, lp):
        if len(lp.streak) < self.limit:
            return
        if lp.bar is not None:
            lp.bar.close()
        ckpt = lp.run.checkpointer
        ckpt.wait()
        last = ckpt.latest_step()
        raise TrainingDiverged(
            f"{len(lp.streak)} non-finite steps in a row (steps {lp.streak[0]}-{lp.streak[-1]}, "
            f"train.max_nonfinite_steps={self.limit}); stopped. Newest checkpoint: "
            + (f"step {last} in {ckpt.directory}" if last is not None else "none")
        )


@dataclasses.dataclass
class LogHook(Hook):
    """A metrics row (metrics.jsonl, TensorBoard, the bar) for the window of steps since
    the last one, once all of them have finished."""

    def after_step(self, lp):
        if not (lp.window and self.due(lp) and not lp.pending):
            return
        rec = lp.window.record(lp.done)
        lp.log.write(rec)
        lp.summary.update(train_loss=rec["loss"], tokens_per_s=rec["tokens_per_s"])
        lp.window.reset(lp.done)
        if lp.bar is not None:  # the logged window's figures, as in metrics.jsonl
            lp.bar.set_postfix(
                loss=f"{rec['loss']:.3f}",
                lr=f"{rec['lr']:.2e}",
                gnorm=f"{rec['grad_norm']:.2f}",
                tok_s=f"{rec['tokens_per_s']:.0f}",
                mfu=f"{rec['mfu']:.1%}" if rec.get("mfu") else "n/a",
                **(
                    {"margin": f"{rec['rewards/margins']:.3f}", "acc": f"{rec['rewards/accuracies']:.2f}"}
                    if "rewards/margins" in rec
                    else {}
                ),
                **({"reward": f"{rec['reward']:.3f}", "kl": f"{rec['kl']:.4f}"} if "reward" in rec else {}),  # GRPO
                time=format_window(rec),
            )


@dataclasses.dataclass
class EvalHook(Hook):
    """The objective's evaluation (`measures.for_run`: what is measured, and the keys it logs)
    every N steps and at the last one, not when stopping early; its time is kept out of the
    window's throughput."""

    evaluation: Any = None  # ready(lp), measure(lp) -> measures.Measured; None: no eval

    def after_step(self, lp):
        if self.evaluation is None or not self.every or lp.stop is not None or not self.due(lp):
            return
        if not self.evaluation.ready(lp):
            return
        lp.timer.switch("eval")
        t_eval = time.perf_counter()
        m = self.evaluation.measure(lp)
        lp.log.write({"step": lp.done, **m.record})
        lp.summary.update(m.summary)
        if lp.bar is not None:
            lp.bar.write(m.line)
        lp.window.add_eval_time(time.perf_counter() - t_eval)
        lp.timer.switch("other")


@dataclasses.dataclass
class CheckpointHook(Hook):
    """An asynchronous save every N steps, at the last step and when stopping. None
    inside a run of skipped steps (the newest stays the last good update: the state is
    unchanged, only the data position moved), unless the run ends here."""

    def needs_metrics(self, lp):
        return self.due(lp)

    def after_step(self, lp):
        lp.timer.switch("checkpoint")
        if self.due(lp) and (not lp.streak or lp.stop is not None or lp.done == lp.last):
            lora = lp.run.lora_base is not None  # a LoRA run saves its adapters (and their state) only
            with nvme_run.saved(lp.run, lp.state) as state:  # nvme: streamed out of the layer files
                lp.run.checkpointer.save(lp.done, saved_state(state) if lora else state, self.extras(lp))
        lp.timer.switch("other")

    @staticmethod
    def extras(lp: LoopState) -> dict:
        return {
            "step": lp.done,
            "data": lp.batches.get_state(),
            "rng": rng_to_json(lp.run.rng),
            "config": config_to_dict(lp.cfg),
            **({} if lp.run.lora_base is None else {"lora_base": lp.run.lora_base}),
        }

    def at_end(self, lp):
        lp.timer.switch("checkpoint")
        lp.run.checkpointer.wait()  # the writes' commit is part of the run's checkpoint cost


@dataclasses.dataclass
class SampleHook(Hook):
    """A sample from the trained model at the end of a run that was not stopped early, as
    the objective makes it (`measures.for_run`), when the run asked for one."""

    sampler: Any = None  # ready(), sample(lp) -> str; None: no sample

    def at_end(self, lp):
        lp.timer.switch("sample")
        if self.sampler is None or not self.sampler.ready() or lp.stop is not None:
            return
        lp.summary["sample"] = self.sampler.sample(lp)


def default_hooks(cfg, profiler: ProfileWindow) -> list[Hook]:
    """The trainer's hooks for `cfg`, in the order they run."""
    c = cfg.train
    evaluation, sampler = measures.for_run(cfg)
    return [
        ProfileHook(profiler=profiler),
        NonFiniteGuard(limit=c.max_nonfinite_steps),
        LogHook(every=c.log_every),
        EvalHook(every=c.eval_every, evaluation=evaluation),
        CheckpointHook(every=c.checkpoint_every),
        SampleHook(sampler=sampler),
    ]
