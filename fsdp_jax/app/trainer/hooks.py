"""What the training loop does besides stepping: hooks, each due every N steps.

The loop (`fsdp_jax.app.trainer.loop`) steps the model and hands each hook the `LoopState`
after every step, in order: profile, non-finite guard, log (`every=train.log_every`),
eval (`every=train.eval_every`), checkpoint (`every=train.checkpoint_every`); at the
end, after the last step, `at_end` runs in the same order (sampling is a hook that
only acts there). A hook is due at multiples of `every`, at the last step and when
the run is stopping (`Hook.due`); each hook narrows that to what it needs.
"""

from __future__ import annotations

import dataclasses
import math
import time
from collections import deque
from typing import Any

import jax

from fsdp_jax.app.config.parse import config_to_dict
from fsdp_jax.app.data.batches import evaluate
from fsdp_jax.app.objectives.preference_run import evaluate_pairs, is_preference, load_pairs
from fsdp_jax.app.objectives.reference import without_reference
from fsdp_jax.app.trainer import nvme_run
from fsdp_jax.app.trainer.lora_state import saved_state
from fsdp_jax.app.trainer.metrics import LogWindow, MetricsLog, sample_text
from fsdp_jax.app.trainer.setup import rng_to_json
from fsdp_jax.app.trainer.timing import ProfileWindow, StepTimer, format_window
from fsdp_jax.errors import TrainingDiverged
from fsdp_jax.sharding import offload


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
    """Mean validation loss (not when stopping early); its time is kept out of the
    window's throughput."""

    def after_step(self, lp):
        if not lp.val or lp.stop is not None or not self.due(lp):
            return
        lp.timer.switch("eval")
        t_eval = time.perf_counter()
        if is_preference(lp.cfg):  # held-out pairs: the loss and TRL's eval_ metrics
            rec = evaluate_pairs(lp.run, lp.state.params, lp.val, lp.state.model_state)
            vl = rec["eval_loss"]
        else:
            vl = evaluate(lp.run, lp.state.params, lp.val, lp.state.model_state)
            rec = {}
        lp.log.write({"step": lp.done, "val_loss": vl, **rec})
        if rec:  # a pair loss, not nats per token
            lp.summary["eval_loss"], lp.summary["eval_accuracy"] = vl, rec["eval_rewards/accuracies"]
        else:
            lp.summary["val_loss"] = vl
        if lp.bar is not None:
            lp.bar.write(
                f"step {lp.done}: eval_loss {vl:.4f}, eval_rewards/accuracies {rec['eval_rewards/accuracies']:.3f}"
                if rec
                else f"step {lp.done}: val_loss {vl:.4f} ({vl / math.log(2):.3f} bits/token)"
            )
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
    """`train.sample_tokens` tokens of text from the trained model, at the end of a run
    that was not stopped early."""

    tokens: int = 0

    def at_end(self, lp):
        lp.timer.switch("sample")
        if not self.tokens or lp.stop is not None:
            return
        run = lp.run
        on_device = offload.on_device(run.plan.params)  # sampling reads params on the device
        val, model = lp.val, run.model
        if is_preference(lp.cfg):  # the policy alone (its reference rides in model state)
            model = without_reference(model) if run.plan.model_state is not None else model
            if not val:  # no held-out pairs: the first training pair's prompt
                arrays, _ = load_pairs(lp.cfg)  # read once per process, cached
                val = [{k: v[:1] for k, v in arrays.items()}]
        lp.summary["sample"] = sample_text(
            model,
            dataclasses.replace(run.plan, params=on_device),
            lp.cfg,
            jax.device_put(lp.state.params, on_device),
            val,
            run.rng,
        )


def default_hooks(cfg, profiler: ProfileWindow) -> list[Hook]:
    """The trainer's hooks for `cfg`, in the order they run."""
    c = cfg.train
    return [
        ProfileHook(profiler=profiler),
        NonFiniteGuard(limit=c.max_nonfinite_steps),
        LogHook(every=c.log_every),
        EvalHook(every=c.eval_every),
        CheckpointHook(every=c.checkpoint_every),
        SampleHook(tokens=c.sample_tokens),  # a GRPO run swaps it for its own (trainer.grpo_hooks)
    ]
