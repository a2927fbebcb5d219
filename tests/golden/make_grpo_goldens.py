#!/usr/bin/env python
"""Regenerate tests/golden/grpo/goldens.json: what TRL's GRPOTrainer computes on one batch.

Needs torch + transformers + trl (+ accelerate), which the project never installs; use the
golden venv (tests/golden/README.md):

    .venv-golden/bin/python tests/golden/make_grpo_goldens.py

Model: the tiny random `llama3` checkpoint of tests/golden/hf (float32). The policy is the
checkpoint; the reference is the same checkpoint with every weight times `REF_SCALE` (the JAX
side builds it exactly from the imported params). One generation batch: `PROMPTS` (token ids,
left-padded as GRPOTrainer pads them), `G` completions each (right-padded, `completion_mask`
0 after a row's end), rewards of two reward functions with `WEIGHTS`.

- Advantages: the lines of `GRPOTrainer._generate_and_score_completions` (TRL 1.16,
  `multi_objective_aggregation="sum_then_normalize"`) that turn `rewards_per_func` into
  advantages, for `scale_rewards` group / batch / none, with TRL's own `nanstd` (the method
  also generates, so its reward-to-advantage lines are run here as written there).
- Log-probs and the loss: the policy and reference patched by TRL's `add_fused_lm_head` with
  the case's temperature (as `GRPOTrainer.__init__` patches them); the reference's per-token
  log-probs by `GRPOTrainer._get_per_token_logps_and_entropies`; `old_per_token_logps` =
  the policy's plus fixed noise (so the ratio is clipped on both sides); then
  `GRPOTrainer._compute_loss` on that batch for each case, its logged metrics read back from
  `_metrics["train"]`. The trainer is built without running its `__init__` (no dataset, no
  generation); it gets the attributes its loss code reads.

Written: `grpo/goldens.json` {"batch": {...}, "advantages": {scale: [...]}, "cases": {name:
{config, "out": {metric: value}}}, "versions"}.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
OUT = HERE / "grpo"
REF_SCALE = 0.9
G = 4
MAX_NEW = 6
PROMPTS = [[1, 17, 42, 99, 3], [1, 5, 201], [9, 8, 7, 6, 5, 4, 3]]
WEIGHTS = [1.0, 0.5]
CASES = {  # name: config of GRPOTrainer's loss
    "grpo": dict(loss_type="grpo", beta=0.04, epsilon=0.2, epsilon_high=0.2, temperature=1.0),
    "grpo_beta0": dict(loss_type="grpo", beta=0.0, epsilon=0.2, epsilon_high=0.2, temperature=1.0),
    "bnpo": dict(loss_type="bnpo", beta=0.04, epsilon=0.2, epsilon_high=0.2, temperature=1.0),
    "dr_grpo": dict(loss_type="dr_grpo", beta=0.04, epsilon=0.2, epsilon_high=0.2, temperature=1.0),
    "dapo": dict(loss_type="dapo", beta=0.0, epsilon=0.2, epsilon_high=0.28, temperature=1.0),
    "dapo_t07_kl": dict(loss_type="dapo", beta=0.1, epsilon=0.1, epsilon_high=0.3, temperature=0.7),
}
METRICS = (
    "kl",
    "entropy",
    "clip_ratio/low_mean",
    "clip_ratio/high_mean",
    "clip_ratio/region_mean",
    "clip_ratio/low_min",
    "clip_ratio/high_max",
)


def batch():
    """Left-padded prompts (repeated G times, as GRPOTrainer repeats them), completions."""
    g = torch.Generator().manual_seed(0)
    rows = [p for p in PROMPTS for _ in range(G)]
    width = max(map(len, PROMPTS))
    prompt_ids = torch.zeros(len(rows), width, dtype=torch.long)
    prompt_mask = torch.zeros_like(prompt_ids)
    for i, p in enumerate(rows):
        prompt_ids[i, width - len(p) :] = torch.tensor(p)
        prompt_mask[i, width - len(p) :] = 1
    completion_ids = torch.randint(3, 256, (len(rows), MAX_NEW), generator=g)
    lengths = torch.randint(1, MAX_NEW + 1, (len(rows),), generator=g)
    lengths[0] = MAX_NEW
    completion_mask = (torch.arange(MAX_NEW)[None] < lengths[:, None]).long()
    completion_ids = completion_ids * completion_mask  # pad id 0 after a row's end
    rewards_per_func = torch.randint(0, 3, (len(rows), len(WEIGHTS)), generator=g).float()
    rewards_per_func[G : 2 * G] = 1.0  # one group with equal rewards (zero std)
    noise = torch.randn(len(rows), MAX_NEW, generator=g) * 0.3
    return dict(
        prompt_ids=prompt_ids,
        prompt_mask=prompt_mask,
        completion_ids=completion_ids,
        completion_mask=completion_mask,
        rewards_per_func=rewards_per_func,
        noise=noise,
    )


def advantages(rewards_per_func, scale_rewards):
    """GRPOTrainer._generate_and_score_completions, sum_then_normalize (TRL 1.16), as written there."""
    from trl.trainer.utils import nanstd

    num_generations = G
    reward_weights = torch.tensor(WEIGHTS)
    unscorable_mask = torch.isnan(rewards_per_func).all(dim=1)
    rewards = (rewards_per_func * reward_weights.unsqueeze(0)).nansum(dim=1)
    rewards[unscorable_mask] = torch.nan
    mean_grouped_rewards = torch.nanmean(rewards.view(-1, num_generations), dim=1)
    mean_grouped_rewards = mean_grouped_rewards.repeat_interleave(num_generations, dim=0)
    if scale_rewards in ["group", "none"]:
        std_rewards = nanstd(rewards.view(-1, num_generations), dim=1)
        std_rewards = std_rewards.repeat_interleave(num_generations, dim=0)
    else:  # batch
        std_rewards = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean_grouped_rewards
    if scale_rewards != "none":
        adv = adv / (std_rewards + 1e-4)
    return torch.nan_to_num(adv, nan=0.0)


def models(temperature):
    from transformers import AutoModelForCausalLM
    from trl.trainer.utils import add_fused_lm_head

    policy = AutoModelForCausalLM.from_pretrained(HERE / "hf" / "llama3", dtype=torch.float32)
    ref = AutoModelForCausalLM.from_pretrained(HERE / "hf" / "llama3", dtype=torch.float32).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.mul_(REF_SCALE)
    add_fused_lm_head(policy, temperature=temperature, outputs=("log_probs", "entropy"))
    add_fused_lm_head(ref, temperature=temperature)
    return policy, ref


def trainer(policy, cfg):
    from accelerate import Accelerator
    from trl import GRPOTrainer

    t = GRPOTrainer.__new__(GRPOTrainer)
    t.model, t.accelerator = policy, Accelerator(cpu=True)
    t.loss_type, t.beta, t.temperature = cfg["loss_type"], cfg["beta"], cfg["temperature"]
    t.epsilon_low, t.epsilon_high = cfg["epsilon"], cfg["epsilon_high"]
    t.max_completion_length = MAX_NEW
    t.top_entropy_quantile, t.off_policy_mask_threshold = 1.0, None
    t.importance_sampling_level, t.use_vllm, t.aux_loss_enabled = "token", False, False
    t._entropy_bonus_enabled = False
    t.current_gradient_accumulation_steps = 1
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t.args = type("Args", (), {"delta": None, "use_bias_correction_kl": False, "steps_per_generation": 1})()
    return t


def case(cfg, b, adv):
    policy, ref = models(cfg["temperature"])
    t = trainer(policy, cfg)
    ids = torch.cat([b["prompt_ids"], b["completion_ids"]], dim=1)
    att = torch.cat([b["prompt_mask"], b["completion_mask"]], dim=1)
    with torch.no_grad():
        logps, _, _ = t._get_per_token_logps_and_entropies(policy, ids, att, MAX_NEW)
        ref_logps, _, _ = t._get_per_token_logps_and_entropies(ref, ids, att, MAX_NEW)
    old = (logps + b["noise"]) * b["completion_mask"]
    inputs = dict(
        prompt_ids=b["prompt_ids"],
        prompt_mask=b["prompt_mask"],
        completion_ids=b["completion_ids"],
        completion_mask=b["completion_mask"],
        advantages=adv,
        old_per_token_logps=old,
        ref_per_token_logps=ref_logps,
        num_items_in_batch=b["completion_mask"].sum(),
    )
    policy.train()  # mode "train" (no dropout in this config)
    loss = t._compute_loss(policy, inputs)
    loss.backward()
    grad_norm = torch.sqrt(sum((p.grad.double() ** 2).sum() for p in policy.parameters() if p.grad is not None))
    out = {"loss": float(loss), "grad_norm": float(grad_norm)}
    out.update({k: float(v[-1]) for k, v in t._metrics["train"].items() if k in METRICS})
    extra = {"old_per_token_logps": old.tolist(), "ref_per_token_logps": ref_logps.tolist()}
    return out, extra


def main() -> None:
    import transformers
    import trl

    torch.set_grad_enabled(True)
    b = batch()
    adv = {s: advantages(b["rewards_per_func"], s) for s in ("group", "batch", "none")}
    goldens = {
        "versions": {"torch": torch.__version__, "transformers": transformers.__version__, "trl": trl.__version__},
        "ref_scale": REF_SCALE,
        "num_generations": G,
        "max_completion_length": MAX_NEW,
        "reward_weights": WEIGHTS,
        "batch": {k: v.tolist() for k, v in b.items() if k != "noise"},
        "advantages": {k: v.tolist() for k, v in adv.items()},
        "cases": {},
    }
    for i, (name, cfg) in enumerate(CASES.items()):
        scale = ("group", "batch", "none")[i % 3]
        out, extra = case(cfg, b, adv[scale])
        goldens["cases"][name] = {"config": dict(cfg, scale_rewards=scale), "out": out, **extra}
        print(name, scale, {k: round(v, 6) for k, v in out.items()}, file=sys.stderr)
    OUT.mkdir(exist_ok=True)
    (OUT / "goldens.json").write_text(json.dumps(goldens, indent=1) + "\n")


if __name__ == "__main__":
    main()
