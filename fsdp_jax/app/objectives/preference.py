"""Preference objectives: DPO and its relatives, with TRL's definitions and metric names.

A preference batch holds pairs: every leaf has a leading pair dim P and a second dim of
2 (chosen, rejected), so any split of the batch (devices, microbatches) keeps a pair
together. `tokens` (P, 2, L) int32 are prompt + completion right-padded (TRL's
`DataCollatorForPreference` rows), `completion` (P, 2, L) marks the completion tokens
(TRL's `completion_mask`), `attention` (P, 2, L) the real ones, and `ref_logps` (P, 2)
f32, when present, holds precomputed reference log-probs (`precompute_ref_log_probs`).
The model reads `tokens[..., :-1]` and is scored on `tokens[..., 1:]`.

Losses (`PreferenceSpec.loss`), as TRL computes them:

| loss | TRL | log-probs | per pair |
|---|---|---|---|
| dpo | DPOTrainer `sigmoid` | sums | -(1-ls) logsig(b d) - ls logsig(-b d), d = chosen - rejected log-ratio |
| ipo | DPOTrainer `ipo` | sums (d per token) | (d_c / n_c - d_r / n_r - 1 / 2b)^2 |
| hinge | DPOTrainer `hinge` | sums | relu(1 - b d) |
| simpo | CPOTrainer `simpo` | means | -(1-ls) logsig(b (m_c - m_r) - g) - ls logsig(-...), + alpha nll |
| orpo | ORPOTrainer | means | nll(chosen, prompt + completion) - b logsig(log odds) |

`dpo` with label smoothing is the conservative DPO of TRL's sigmoid loss before 1.0
(and of CPOTrainer's `sigmoid`); with `label_smoothing=0` it is TRL 1.x's `sigmoid`.
Rewards: b x the log-ratio to the reference (dpo, ipo, hinge) or b x the mean log-prob
(simpo, orpo). Metrics (`finish_metrics`): `rewards/chosen`, `rewards/rejected`,
`rewards/accuracies`, `rewards/margins`, `logps/chosen`, `logps/rejected`,
`logits/chosen`, `logits/rejected` (the vocab-mean logit over completion tokens, as
DPOTrainer logs it), plus `nll_loss` (simpo, orpo), `log_odds_ratio`,
`log_odds_chosen` (orpo).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

LOSSES = ("dpo", "ipo", "hinge", "simpo", "orpo")
REFERENCE_FREE = ("simpo", "orpo")
AVERAGED = ("simpo", "orpo")  # log-probs averaged over the completion's tokens (TRL average_log_prob)


@dataclasses.dataclass(frozen=True)
class PreferenceSpec:
    """What a preference run optimises. `beta`: DPO's beta (IPO's tau, SimPO's and ORPO's
    beta); `label_smoothing` in [0, 0.5) (dpo, simpo); `simpo_gamma`: SimPO's target
    margin; `cpo_alpha`: weight of the chosen NLL added to simpo (0: pure SimPO)."""

    loss: str = "dpo"
    beta: float = 0.1
    label_smoothing: float = 0.0
    simpo_gamma: float = 0.5
    cpo_alpha: float = 0.0

    @property
    def needs_reference(self) -> bool:
        return self.loss not in REFERENCE_FREE


def spec_problem(spec: PreferenceSpec) -> tuple[str, str] | None:
    """(key, message) of the first bad field, else None."""
    if spec.loss not in LOSSES:
        return "loss", f"{spec.loss!r} is invalid; allowed: {', '.join(LOSSES)}"
    if not spec.beta > 0:
        return "beta", f"{spec.beta!r} is invalid; must be > 0"
    if not 0 <= spec.label_smoothing < 0.5:
        return "label_smoothing", f"{spec.label_smoothing!r} is invalid; must be in [0, 0.5)"
    if spec.cpo_alpha < 0:
        return "cpo_alpha", f"{spec.cpo_alpha!r} is invalid; must be >= 0"
    return None


def token_logps(logits, targets):
    """log p(target) per position, f32: logits (N, S, V), targets (N, S) -> (N, S)."""
    logp = jax.nn.log_softmax(logits.astype(jnp.float32), axis=-1)
    return jnp.take_along_axis(logp, targets[..., None].astype(jnp.int32), axis=-1)[..., 0]


def sequence_logps(logits, targets, mask):
    """(sum, count) of the masked targets' log-probs per row: (N,), (N,)."""
    m = mask.astype(jnp.float32)
    return (token_logps(logits, targets) * m).sum(-1), m.sum(-1)


def _log1mexp(x):
    """log(1 - exp(x)) for x < 0, as TRL's `log1mexp` (stable on both sides of -log 2)."""
    return jnp.where(x > -0.6931472, jnp.log(-jnp.expm1(x)), jnp.log1p(-jnp.exp(x)))


def _smoothed(z, ls):
    return -jax.nn.log_sigmoid(z) * (1 - ls) - jax.nn.log_sigmoid(-z) * ls


def pair_losses(spec: PreferenceSpec, logps, counts, ref_logps=None):
    """Per-pair loss, chosen and rejected rewards, and the log-probs the metrics report.

    `logps`: (P, 2) completion log-prob sums of the policy, `counts`: (P, 2) completion
    token counts, `ref_logps`: (P, 2) sums of the reference (ignored by simpo / orpo).
    Returns (losses (P,), rewards (P, 2), reported logps (P, 2), extras: per-pair (P,) metrics)."""
    b, ls = spec.beta, spec.label_smoothing
    if spec.loss in AVERAGED:
        mean = logps / jnp.maximum(counts, 1.0)
        rewards = b * jax.lax.stop_gradient(mean)
        if spec.loss == "simpo":
            z = b * ((mean[:, 0] - mean[:, 1]) - spec.simpo_gamma / b)
            return _smoothed(z, ls), rewards, mean, {}
        log_odds = (mean[:, 0] - mean[:, 1]) - (_log1mexp(mean[:, 0]) - _log1mexp(mean[:, 1]))
        ratio = jax.nn.log_sigmoid(log_odds)
        extras = {"log_odds_ratio": ratio, "log_odds_chosen": log_odds}
        return -b * ratio, rewards, mean, extras
    ratios = logps - ref_logps  # (P, 2) log pi / pi_ref
    d = ratios[:, 0] - ratios[:, 1]
    if spec.loss == "dpo":
        losses = _smoothed(b * d, ls)
    elif spec.loss == "hinge":
        losses = jax.nn.relu(1 - b * d)
    else:  # ipo: length-normalised log-ratios (TRL 1.x, confirmed with IPO's authors)
        avg = ratios / jnp.maximum(counts, 1.0)
        losses = (avg[:, 0] - avg[:, 1] - 1 / (2 * b)) ** 2
    return losses, b * jax.lax.stop_gradient(ratios), logps, {}


def preference_terms(spec: PreferenceSpec, logits, batch, ref_logps=None):
    """The pair loss of one (micro)batch and its metric sums.

    `logits`: (2P, S, V) of `tokens[..., :-1]` laid out (P, 2) -> 2P rows; `batch` as the
    module docstring says; `ref_logps`: (P, 2). Returns (loss scalar, aux): aux holds
    per-batch means of the pair metrics and sums + counts of the token metrics, so
    microbatches average exactly (`finish_metrics`)."""
    p = batch["tokens"].shape[0]
    targets = batch["tokens"][..., 1:].reshape(2 * p, -1)
    cmask = batch["completion"][..., 1:].reshape(2 * p, -1).astype(jnp.float32)
    sums, counts = sequence_logps(logits, targets, cmask)
    sums, counts = sums.reshape(p, 2), counts.reshape(p, 2)
    losses, rewards, reported, extras = pair_losses(spec, sums, counts, ref_logps)
    loss, extras = jnp.mean(losses), {k: jnp.mean(v) for k, v in extras.items()}
    if spec.loss == "orpo":  # chosen rows, prompt + completion (TRL: labels where attention)
        nll = _mean_nll(logits, targets, batch["attention"][..., 1:].reshape(2 * p, -1), p)
        loss, extras = loss + nll, {**extras, "nll_loss": jax.lax.stop_gradient(nll)}
    elif spec.loss == "simpo":  # CPO's NLL on the chosen completions; TRL logs 0 when cpo_alpha is 0
        nll = _mean_nll(logits, targets, cmask, p) if spec.cpo_alpha else jnp.zeros((), jnp.float32)
        loss, extras = loss + spec.cpo_alpha * nll, {**extras, "nll_loss": jax.lax.stop_gradient(nll)}
    vocab_mean = jax.lax.stop_gradient(logits.astype(jnp.float32).mean(-1)).reshape(p, 2, -1)  # (P, 2, S)
    cm = cmask.reshape(p, 2, -1)
    margins = rewards[:, 0] - rewards[:, 1]
    aux = {
        "rewards/chosen": rewards[:, 0].mean(),
        "rewards/rejected": rewards[:, 1].mean(),
        "rewards/accuracies": (rewards[:, 0] > rewards[:, 1]).astype(jnp.float32).mean(),
        "rewards/margins": margins.mean(),
        "logps/chosen": jax.lax.stop_gradient(reported[:, 0]).mean(),
        "logps/rejected": jax.lax.stop_gradient(reported[:, 1]).mean(),
        "logits_sum/chosen": (vocab_mean[:, 0] * cm[:, 0]).sum(),
        "logits_sum/rejected": (vocab_mean[:, 1] * cm[:, 1]).sum(),
        "tokens/chosen": cm[:, 0].sum(),
        "tokens/rejected": cm[:, 1].sum(),
        **{k: jax.lax.stop_gradient(v) for k, v in extras.items()},
    }
    return loss, aux


def _mean_nll(logits, targets, mask, p):
    """Cross-entropy of the chosen rows (even rows of the 2P), mean over `mask`'s tokens."""
    lp = token_logps(logits.reshape(p, 2, *logits.shape[1:])[:, 0], targets.reshape(p, 2, -1)[:, 0])
    m = mask.reshape(p, 2, -1)[:, 0].astype(jnp.float32)
    return -(lp * m).sum() / jnp.maximum(m.sum(), 1.0)


def finish_metrics(auxes) -> dict[str, float]:
    """Record fields from step aux dicts (leaves may carry a leading microbatch dim): pair
    metrics averaged (packed rows' aux holds sums and the pair count `pairs`:
    `preference_packed`), `logits/*` as token-weighted means (DPOTrainer's); a mixture of
    experts' `router` aux is left to the router's own summary."""

    if not auxes:
        return {}
    out: dict[str, float] = {}
    keys = [k for k in auxes[0] if not k.startswith(("logits_sum/", "tokens/")) and k not in ("router", "pairs")]
    pairs = sum(float(np.asarray(a["pairs"], np.float64).sum()) for a in auxes) if "pairs" in auxes[0] else 0.0
    for k in keys:
        if "pairs" in auxes[0]:
            out[k] = sum(float(np.asarray(a[k], np.float64).sum()) for a in auxes) / max(pairs, 1.0)
        else:
            out[k] = float(np.mean([np.asarray(a[k], np.float64).mean() for a in auxes]))
    for side in ("chosen", "rejected"):
        total = sum(float(np.asarray(a[f"logits_sum/{side}"]).sum()) for a in auxes)
        n = sum(float(np.asarray(a[f"tokens/{side}"]).sum()) for a in auxes)
        out[f"logits/{side}"] = total / n if n else 0.0
    return out
