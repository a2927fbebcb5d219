"""The GRPO run's eval and sample hooks (`objective: grpo`): in place of the SFT ones, which
read a validation corpus the run has none of (`fsdp_jax.app.objectives.grpo_eval`)."""

from __future__ import annotations

import dataclasses
import time

from fsdp_jax.app.objectives import grpo_eval
from fsdp_jax.app.trainer.hooks import EvalHook, Hook, LoopState, SampleHook


@dataclasses.dataclass
class GrpoEvalHook(Hook):
    """Generation + rewards on `grpo.eval_path`'s prompts every `every` steps (not when
    stopping early); logged as TRL's `eval_*` metrics, its time kept out of throughput."""

    prompts: object = None  # the eval PromptSet, or None: no eval

    def after_step(self, lp: LoopState):
        if self.prompts is None or not self.every or lp.stop is not None or not self.due(lp):
            return
        lp.timer.switch("eval")
        t0 = time.perf_counter()
        m = grpo_eval.evaluate(lp.batches, lp.state.params, self.prompts)
        lp.log.write({"step": lp.done, **m})
        lp.summary["eval_reward"] = m["eval_reward"]
        if lp.bar is not None:
            lp.bar.write(f"step {lp.done}: eval_reward {m['eval_reward']:.4f}")
        lp.window.add_eval_time(time.perf_counter() - t0)
        lp.timer.switch("other")


@dataclasses.dataclass
class GrpoSampleHook(Hook):
    """One completion of the first (eval, else training) prompt at the end of a run that was
    not stopped early, when `train.sample_tokens` > 0 (its length is grpo.max_new_tokens)."""

    on: bool = False
    prompts: object = None

    def at_end(self, lp: LoopState):
        if not self.on or lp.stop is not None:
            return
        lp.timer.switch("sample")
        lp.summary["sample"] = grpo_eval.sample(lp.batches, lp.state.params, self.prompts or lp.batches.prompts)


def with_grpo_hooks(hooks: list[Hook], cfg) -> list[Hook]:
    """`hooks` (`hooks.default_hooks`) with the SFT eval and sample hooks replaced by the GRPO
    ones, in their places."""
    prompts = grpo_eval.eval_prompts(cfg)
    swap = {
        EvalHook: GrpoEvalHook(every=cfg.train.eval_every, prompts=prompts),
        SampleHook: GrpoSampleHook(on=cfg.train.sample_tokens > 0, prompts=prompts),
    }
    return [swap.get(type(h), h) for h in hooks]
