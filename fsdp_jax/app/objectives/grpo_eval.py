"""A GRPO run's eval and end-of-run sample: the policy generates for held-out prompts and the
run's rewards score it, nothing is trained.

Eval (`evaluate`, every `train.eval_every` steps when `grpo.eval_path` names prompt rows):
`train.eval_batches` generation batches of `train.global_batch / num_generations` eval prompts,
in file order (wrapping), each sampled `num_generations` times with the run's sampling and the
same keys at every eval (`fold_in(key(train.seed + 2), k)`: evals differ only by the params);
logged under TRL's eval names, `eval_` + the generation metrics (`eval_reward`,
`eval_reward_std`, `eval_rewards/<fn>/mean`, `eval_completions/mean_length`, ...).
Sample (`sample`, at the end when `train.sample_tokens` > 0): the first prompt (eval prompts
if any, else the training prompts) and one completion of it, as text.
"""

from __future__ import annotations

import jax
import numpy as np

from fsdp_jax.app.objectives.grpo import group_advantages
from fsdp_jax.app.objectives.grpo_data import load_prompts
from fsdp_jax.app.objectives.grpo_run import stop_tokens


def eval_prompts(cfg):
    """The eval prompt rows (`grpo.eval_path`), or None."""
    return None if cfg.grpo.eval_path is None else load_prompts(cfg, eval_set=True)


def _batch_indices(n_prompts: int, per: int, g: int, k: int) -> np.ndarray:
    return np.repeat((np.arange(per) + k * per) % n_prompts, g)


def evaluate(batches, params, prompt_set) -> dict[str, float]:
    """The eval metrics (module docstring) of `params` on `prompt_set`; `batches`: the run's
    `grpo_run.GrpoBatches` (its sampler, rewards and metric names)."""
    cfg, spec = batches.cfg, batches.spec
    g = spec.num_generations
    key = jax.random.key(cfg.train.seed + 2)
    parts = [
        batches.rollout(
            prompt_set, _batch_indices(len(prompt_set), batches.rows // g, g, k), params, jax.random.fold_in(key, k)
        )
        for k in range(max(cfg.train.eval_batches, 1))
    ]
    per_func = np.concatenate([r["per_func"] for r in parts])
    comp = np.concatenate([r["comp"] for r in parts])
    clen = np.concatenate([r["clen"] for r in parts])
    _, total = group_advantages(per_func, [f.weight for f in batches.fns], g, spec.scale_rewards)
    metrics = batches.metrics(per_func, total, comp, clen, set(stop_tokens(cfg)))
    return {f"eval_{k}": v for k, v in metrics.items()}


def sample(batches, params, prompt_set) -> str:
    """The first prompt of `prompt_set` and one completion of it from `params` (a whole
    generation batch is sampled: the sampler's compiled shape), as text."""
    g = batches.spec.num_generations
    r = batches.rollout(
        prompt_set,
        _batch_indices(len(prompt_set), batches.rows // g, g, 0),
        params,
        jax.random.key(batches.cfg.train.seed + 3),
    )
    prompt = prompt_set.texts[0]
    head = prompt if isinstance(prompt, str) else "\n".join(f"[{m.get('role')}] {m.get('content')}" for m in prompt)
    return f"{head}{r['texts'][0]}"
