"""GRPO: group-relative policy optimisation with TRL's `GRPOTrainer` definitions and metric names.

A generation batch holds `num_generations` (G) completions of each prompt, rows of one prompt
adjacent. Rewards -> advantages (`group_advantages`, TRL's `sum_then_normalize`): the
weighted sum of the reward functions' values, minus its group mean, divided by (std + 1e-4)
where std is the group's (`scale_rewards="group"`), the batch's (`"batch"`), or not at all
(`"none"`: Dr. GRPO), Bessel-corrected as TRL's `nanstd`.

The loss of a batch (`grpo_terms`): per completion token, log p = log_softmax(logits /
temperature)[token], ratio r = exp(log p - log p_old) (`old_logps`; without them the
detached current log-probs, TRL's `num_iterations=1` shortcut, so r = 1 in value),
per-token loss -min(r A, clip(r, 1 - epsilon, 1 + epsilon_high) A) + beta k3, where k3 =
exp(ref - log p) - (ref - log p) - 1 (Schulman's estimator of KL(pi || ref)); beta 0 skips
the reference forward. Aggregation (`loss_type`):

| loss_type | TRL | loss |
|---|---|---|
| grpo | `grpo` | mean over rows of (sum of the row's token losses / its length) |
| bnpo | `bnpo` | sum of token losses / tokens in the batch |
| dr_grpo | `dr_grpo` | sum of token losses / (rows x max_new_tokens) |
| dapo | `dapo` (TRL's default) | sum of token losses / tokens in the generation batch |

One optimizer step per generation batch and pass (`num_iterations` passes), so the
generation batch is the step's batch and `dapo` equals `bnpo` here (they differ in TRL only
when a generation batch is split over several optimizer steps).
Metrics (`finish_metrics`): `kl`, `entropy`, `clip_ratio/low_mean`, `clip_ratio/high_mean`,
`clip_ratio/region_mean` (token-weighted means over the completion tokens),
`clip_ratio/low_min`, `clip_ratio/high_max` (over rows of the per-row means), as TRL logs them.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

LOSS_TYPES = ("grpo", "bnpo", "dr_grpo", "dapo")
SCALE_REWARDS = ("group", "batch", "none")


@dataclasses.dataclass(frozen=True)
class GrpoSpec:
    """What a GRPO run samples and optimises (TRL's `GRPOConfig` names and defaults, except
    `max_new_tokens` = TRL's `max_completion_length`; `epsilon_high` 0 = `epsilon`)."""

    num_generations: int = 8
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    epsilon: float = 0.2
    epsilon_high: float = 0.0
    beta: float = 0.0
    loss_type: str = "dapo"
    scale_rewards: str = "group"
    num_iterations: int = 1

    @property
    def eps_high(self) -> float:
        return self.epsilon_high or self.epsilon


def spec_problem(spec: GrpoSpec) -> tuple[str, str] | None:
    """(key, message) of the first bad field, else None."""
    if spec.num_generations < 2:
        return "num_generations", f"{spec.num_generations!r} is invalid; must be >= 2 (a group needs a baseline)"
    if spec.max_new_tokens < 1:
        return "max_new_tokens", f"{spec.max_new_tokens!r} is invalid; must be >= 1"
    if spec.loss_type not in LOSS_TYPES:
        return "loss_type", f"{spec.loss_type!r} is invalid; allowed: {', '.join(LOSS_TYPES)}"
    if spec.scale_rewards not in SCALE_REWARDS:
        return "scale_rewards", f"{spec.scale_rewards!r} is invalid; allowed: {', '.join(SCALE_REWARDS)}"
    if not spec.temperature >= 0:
        return "temperature", f"{spec.temperature!r} is invalid; must be >= 0"
    if not 0 < spec.top_p <= 1:
        return "top_p", f"{spec.top_p!r} is invalid; must be in (0, 1]"
    if spec.top_k < 0:
        return "top_k", f"{spec.top_k!r} is invalid; must be >= 0 (0 = off)"
    if not 0 <= spec.epsilon < 1:
        return "epsilon", f"{spec.epsilon!r} is invalid; must be in [0, 1)"
    if spec.epsilon_high < 0:
        return "epsilon_high", f"{spec.epsilon_high!r} is invalid; must be >= 0 (0 = epsilon)"
    if spec.beta < 0:
        return "beta", f"{spec.beta!r} is invalid; must be >= 0"
    if spec.num_iterations < 1:
        return "num_iterations", f"{spec.num_iterations!r} is invalid; must be >= 1"
    return None


def _nanstd(x, axis=None):
    """TRL's `nanstd`: Bessel-corrected, NaN where fewer than 2 values."""
    n = np.sum(~np.isnan(x), axis=axis, keepdims=True)
    mean = np.nanmean(x, axis=axis, keepdims=True)
    var = np.nanmean((x - mean) ** 2, axis=axis, keepdims=True) * np.where(n > 1, n / np.maximum(n - 1, 1), np.nan)
    return np.sqrt(var)


def group_advantages(rewards_per_func, weights, g: int, scale: str) -> tuple[np.ndarray, np.ndarray]:
    """(advantages (B,), rewards (B,)) float32 from `rewards_per_func` (B, F) and `weights` (F,),
    groups of `g` adjacent rows (TRL's sum_then_normalize; NaN rewards are skipped, a row with
    every reward NaN gets advantage 0)."""
    r = np.asarray(rewards_per_func, np.float32)
    unscorable = np.isnan(r).all(axis=1)
    rewards = np.nansum(r * np.asarray(weights, np.float32)[None], axis=1)
    rewards[unscorable] = np.nan
    grouped = rewards.reshape(-1, g)
    mean = np.repeat(np.nanmean(grouped, axis=1), g)
    if scale == "batch":
        std = np.broadcast_to(_nanstd(rewards), rewards.shape)
    else:
        std = np.repeat(_nanstd(grouped, axis=1)[:, 0], g)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + np.float32(1e-4))
    return np.nan_to_num(adv, nan=0.0).astype(np.float32), rewards


def completion_logits(logits, batch):
    """(B, N, V) logits that score the completion tokens: row b's completion starts after its
    `prompt_len[b]` prompt tokens in `tokens` (B, P + N), right-padded; `logits` (B, L, V)
    of `tokens` (or of `tokens[:, :-1]`: the last position is never read)."""
    n = batch["completion"].shape[1]
    idx = batch["prompt_len"][:, None].astype(jnp.int32) - 1 + jnp.arange(n)[None]  # (B, N)
    return jnp.take_along_axis(logits, idx[..., None], axis=1)


def completion_logps(spec: GrpoSpec, logits, completion):
    """(log-probs (B, N), entropies (B, N)) of `completion` (B, N) under logits / temperature, f32."""
    lp = jax.nn.log_softmax(logits.astype(jnp.float32) / (spec.temperature or 1.0), axis=-1)
    logps = jnp.take_along_axis(lp, completion[..., None].astype(jnp.int32), axis=-1)[..., 0]
    entropy = -jnp.sum(jnp.exp(lp) * lp, axis=-1)
    return logps, entropy


def grpo_terms(spec: GrpoSpec, logits, batch, ref_logps=None):
    """The GRPO loss of one batch and its metric sums.

    `logits` (B, N, V): the completion slots' (`completion_logits`); `batch`: `completion`
    (B, N) ids, `completion_mask` (B, N), `advantages` (B,), optional `old_logps` (B, N);
    `ref_logps` (B, N) when beta > 0. Returns (loss, aux), aux of sums and counts (`finish_metrics`)."""
    mask = batch["completion_mask"].astype(jnp.float32)
    logps, entropy = completion_logps(spec, logits, batch["completion"])
    old = batch.get("old_logps")
    old = jax.lax.stop_gradient(logps) if old is None else old.astype(jnp.float32)
    adv = batch["advantages"].astype(jnp.float32)[:, None]
    coef1 = jnp.exp(logps - old)
    coef2 = jnp.clip(coef1, 1 - spec.epsilon, 1 + spec.eps_high)
    per_token = -jnp.minimum(coef1 * adv, coef2 * adv)
    kl = jnp.zeros_like(per_token)
    if spec.beta:
        d = ref_logps.astype(jnp.float32) - logps
        kl = jnp.exp(d) - d - 1
        per_token = per_token + spec.beta * kl
    counts = mask.sum(-1)
    total = (per_token * mask).sum()
    if spec.loss_type == "grpo":
        loss = jnp.mean((per_token * mask).sum(-1) / jnp.maximum(counts, 1.0))
    elif spec.loss_type == "dr_grpo":
        loss = total / (mask.shape[0] * spec.max_new_tokens)
    else:  # bnpo, dapo
        loss = total / jnp.maximum(mask.sum(), 1.0)
    low = ((coef1 < 1 - spec.epsilon) & (adv < 0)).astype(jnp.float32)
    high = ((coef1 > 1 + spec.eps_high) & (adv > 0)).astype(jnp.float32)
    sg = jax.lax.stop_gradient
    seq = jnp.maximum(counts, 1.0)
    aux = {
        "tokens": mask.sum(),
        "kl_sum": sg((kl * mask).sum()),
        "entropy_sum": sg((entropy * mask).sum()),
        "low_sum": (low * mask).sum(),
        "high_sum": (high * mask).sum(),
        "region_sum": (jnp.maximum(low, high) * mask).sum(),
        "low_min": jnp.min(jnp.where(counts > 0, (low * mask).sum(-1) / seq, jnp.inf)),
        "high_max": jnp.max(jnp.where(counts > 0, (high * mask).sum(-1) / seq, -jnp.inf)),
    }
    return loss, aux


def finish_metrics(auxes, beta: float = 0.0) -> dict[str, float]:
    """TRL's logged loss metrics from step aux dicts (leaves may carry a leading microbatch dim)."""
    if not auxes:
        return {}

    def total(k):
        return sum(float(np.asarray(a[k], np.float64).sum()) for a in auxes)

    n = max(total("tokens"), 1.0)
    out = {"entropy": total("entropy_sum") / n}
    if beta:
        out["kl"] = total("kl_sum") / n
    for side in ("low", "high", "region"):
        out[f"clip_ratio/{side}_mean"] = total(f"{side}_sum") / n
    out["clip_ratio/low_min"] = min(float(np.min(np.asarray(a["low_min"]))) for a in auxes)
    out["clip_ratio/high_max"] = max(float(np.max(np.asarray(a["high_max"]))) for a in auxes)
    return out
