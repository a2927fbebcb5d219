"""What a run's objective measures in the trainer's eval and sample hooks.

`fsdp_jax.app.trainer.hooks.EvalHook` and `SampleHook` own when and the bookkeeping (the
timer's category, the eval time kept out of throughput, metrics.jsonl, the summary, the
bar); the objective supplies what, as two small objects (`for_run`):

- an evaluation: `ready(lp)` (there is something to evaluate) and `measure(lp) -> Measured`
  (the metrics.jsonl keys, the summary's entries, the bar's line);
- a sampler: `ready()` (the run asked for a sample) and `sample(lp) -> str` (the summary's
  `sample`).

By objective: `sft`, the mean next-token loss on the validation corpus and text continuing a
validation prompt; a preference loss (dpo ...), TRL's `eval_` pair metrics on
`preference.eval_path` and the policy (its reference left out) continuing a held-out pair's
prompt; `grpo`, generation + rewards on `grpo.eval_path` (`fsdp_jax.app.objectives.grpo_eval`)
and one completion of its first prompt.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import jax

from fsdp_jax.app.data.batches import evaluate
from fsdp_jax.app.objectives import grpo_eval
from fsdp_jax.app.objectives.grpo_run import is_grpo
from fsdp_jax.app.objectives.preference_run import evaluate_pairs, is_preference, load_pairs
from fsdp_jax.app.objectives.reference import without_reference
from fsdp_jax.app.trainer import nvme_run
from fsdp_jax.app.trainer.metrics import sample_text
from fsdp_jax.sharding import offload


@dataclasses.dataclass(frozen=True)
class Measured:
    """One evaluation: `record` (metrics.jsonl keys after `step`), `summary` (the run
    summary's entries) and `line` (what the progress bar prints)."""

    record: dict[str, float]
    summary: dict[str, float]
    line: str


@dataclasses.dataclass(frozen=True)
class CorpusLoss:
    """`sft`: the mean next-token loss over the run's validation batches (`val_loss`)."""

    def ready(self, lp) -> bool:
        return bool(lp.val)

    def measure(self, lp) -> Measured:
        vl = evaluate(lp.run, nvme_run.whole_params(lp.run, lp.state), lp.val, lp.state.model_state)
        line = f"step {lp.done}: val_loss {vl:.4f} ({vl / math.log(2):.3f} bits/token)"
        return Measured({"val_loss": vl}, {"val_loss": vl}, line)


@dataclasses.dataclass(frozen=True)
class PairMetrics:
    """A preference loss: the held-out pairs' loss and TRL's `eval_` metrics (`val_loss` is
    the pair loss, not nats per token)."""

    def ready(self, lp) -> bool:
        return bool(lp.val)

    def measure(self, lp) -> Measured:
        rec = evaluate_pairs(lp.run, nvme_run.whole_params(lp.run, lp.state), lp.val, lp.state.model_state)
        vl, acc = rec["eval_loss"], rec["eval_rewards/accuracies"]
        line = f"step {lp.done}: eval_loss {vl:.4f}, eval_rewards/accuracies {acc:.3f}"
        return Measured({"val_loss": vl, **rec}, {"eval_loss": vl, "eval_accuracy": acc}, line)


@dataclasses.dataclass(frozen=True)
class GrpoRewards:
    """`grpo`: generation + rewards on `grpo.eval_path`'s prompts (TRL's `eval_*` metrics)."""

    prompts: Any = None  # the eval PromptSet, or None: no eval

    def ready(self, lp) -> bool:
        return self.prompts is not None

    def measure(self, lp) -> Measured:
        m = grpo_eval.evaluate(lp.batches, lp.state.params, self.prompts)
        return Measured(m, {"eval_reward": m["eval_reward"]}, f"step {lp.done}: eval_reward {m['eval_reward']:.4f}")


@dataclasses.dataclass(frozen=True)
class TextSample:
    """`sft`: `tokens` tokens of text continuing a validation prompt (`metrics.sample_text`)."""

    tokens: int = 0

    def ready(self) -> bool:
        return self.tokens > 0

    def policy(self, lp):
        return lp.run.model

    def prompts(self, lp):
        return lp.val

    def sample(self, lp) -> str:
        run = lp.run
        on_device = offload.on_device(run.plan.params)  # sampling reads params on the device
        return sample_text(
            self.policy(lp),
            dataclasses.replace(run.plan, params=on_device),
            lp.cfg,
            jax.device_put(nvme_run.whole_params(run, lp.state), on_device),
            self.prompts(lp),
            run.rng,
        )


@dataclasses.dataclass(frozen=True)
class PairSample(TextSample):
    """A preference loss: the policy alone (its reference rides in model state) continuing
    a held-out pair's prompt, else the first training pair's."""

    def policy(self, lp):
        run = lp.run
        return without_reference(run.model) if run.plan.model_state is not None else run.model

    def prompts(self, lp):
        if lp.val:
            return lp.val
        arrays, _ = load_pairs(lp.cfg)  # read once per process, cached
        return [{k: v[:1] for k, v in arrays.items()}]


@dataclasses.dataclass(frozen=True)
class GrpoSample:
    """`grpo`: one completion (grpo.max_new_tokens long) of the first eval, else training,
    prompt, when `train.sample_tokens` > 0."""

    on: bool = False
    prompts: Any = None

    def ready(self) -> bool:
        return self.on

    def sample(self, lp) -> str:
        return grpo_eval.sample(lp.batches, lp.state.params, self.prompts or lp.batches.prompts)


def for_run(cfg) -> tuple[Any, Any]:
    """(evaluation, sampler) of `cfg`'s objective."""
    if is_grpo(cfg):
        prompts = grpo_eval.eval_prompts(cfg)
        return GrpoRewards(prompts), GrpoSample(on=cfg.train.sample_tokens > 0, prompts=prompts)
    if is_preference(cfg):
        return PairMetrics(), PairSample(cfg.train.sample_tokens)
    return CorpusLoss(), TextSample(cfg.train.sample_tokens)
