"""The preference loss over packed rows (`preference_pack`): per-segment log-prob sums.

A packed batch: `tokens`, `completion`, `segment_ids` (B, L) (pair k of a row is segments
2k + 1, chosen, and 2k + 2, rejected; 0 is padding) and, when precomputed, `ref_logps`
(B, M), M = 2 x pairs per row. The model reads `tokens[:, :-1]` with those segment ids
(attention inside a segment) and positions restarting at 0 per segment (`packed_inputs`);
a target counts only when it is the next token of the same segment. Each sequence's
completion log-prob sum is the per-token log-probs summed against a one-hot of the
segments (`slot_logps`: an einsum at HIGHEST precision, batch-sharded like the logits),
which gives the unpacked batch's (P, 2) sums for the pairs present; empty slots are masked.

The loss is a `TokenSum` over pairs (sum of the pair losses, number of pairs present), so
rows with different pair counts average exactly over devices and microbatches; the metrics
are sums with the pair count `pairs` (`preference.finish_metrics` divides). With one
microbatch the loss and every metric equal the unpacked batch's of the same pairs.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fsdp_jax.app.objectives.preference import PreferenceSpec, pair_losses, token_logps
from fsdp_jax.train.step_parts import TokenSum


def is_packed(batch) -> bool:
    return isinstance(batch, dict) and "segment_ids" in batch


def packed_inputs(batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(inputs, segment ids, positions) (B, L-1) the decoder reads from a packed batch."""
    seg = batch["segment_ids"][:, :-1].astype(jnp.int32)
    idx = jnp.arange(seg.shape[1], dtype=jnp.int32)
    start = jnp.concatenate([jnp.ones_like(seg[:, :1], bool), seg[:, 1:] != seg[:, :-1]], axis=1)
    first = jax.lax.cummax(jnp.where(start, idx, 0), axis=1)
    return batch["tokens"][:, :-1].astype(jnp.int32), seg, idx - first


def target_masks(batch) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(targets int32, real f32: the target is the next token of the same segment, completion f32),
    each (B, L-1)."""
    seg = batch["segment_ids"].astype(jnp.int32)
    same = ((seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)).astype(jnp.float32)
    return batch["tokens"][:, 1:].astype(jnp.int32), same, same * batch["completion"][:, 1:].astype(jnp.float32)


def one_hot_slots(batch, m: int) -> jax.Array:
    """(B, L-1, M) f32: 1 where the input position belongs to slot j (segment j + 1)."""
    seg = batch["segment_ids"][:, :-1].astype(jnp.int32)
    return (seg[..., None] == jnp.arange(1, m + 1, dtype=jnp.int32)).astype(jnp.float32)


def _per_slot(values, onehot):
    return jnp.einsum("bs,bsm->bm", values, onehot, precision=jax.lax.Precision.HIGHEST)


def slot_logps(logits, batch, m: int):
    """(sums, counts) (B, M) of each sequence's completion log-probs, and the one-hot (B, L-1, M)."""
    targets, _, cmask = target_masks(batch)
    onehot = one_hot_slots(batch, m)
    return _per_slot(token_logps(logits, targets) * cmask, onehot), _per_slot(cmask, onehot), onehot


def packed_reference_logps(logits, batch, m: int):
    """(B, M) completion log-prob sums of the reference's logits (no gradient flows)."""
    sums, _, _ = slot_logps(jax.lax.stop_gradient(logits), batch, m)
    return jax.lax.stop_gradient(sums)


def packed_terms(spec: PreferenceSpec, logits, batch, m: int, ref_logps=None):
    """(TokenSum over pairs, aux of sums + `pairs`) of a packed batch; `ref_logps` (B, M)."""
    sums, counts, onehot = slot_logps(logits, batch, m)
    valid = (onehot.sum(1) > 0)[:, 0::2].reshape(-1)  # (B K,): the pair's chosen segment is in the row
    v2 = valid[:, None]
    sums = jnp.where(v2, sums.reshape(-1, 2), -1.0)  # empty slots: finite stand-ins, masked below
    counts = jnp.where(v2, counts.reshape(-1, 2), 1.0)
    ref = None if ref_logps is None else jnp.where(v2, ref_logps.reshape(-1, 2).astype(jnp.float32), -1.0)
    losses, rewards, reported, extras = pair_losses(spec, sums, counts, ref)
    w = valid.astype(jnp.float32)
    n = w.sum()
    total = (losses * w).sum()
    targets, real, cmask = target_masks(batch)
    side = (batch["segment_ids"][:, :-1].astype(jnp.int32) % 2).astype(jnp.float32)  # 1: chosen (odd ids)
    pair_sums = {k: (v * w).sum() for k, v in extras.items()}
    if spec.loss in ("orpo", "simpo"):  # orpo: chosen prompt + completion; simpo: chosen completions
        mask = (real if spec.loss == "orpo" else cmask) * side
        nll = -(token_logps(logits, targets) * mask).sum() / jnp.maximum(mask.sum(), 1.0)
        if spec.loss == "simpo" and not spec.cpo_alpha:
            nll = jnp.zeros((), jnp.float32)  # TRL logs 0 when cpo_alpha is 0
        total = total + n * (1.0 if spec.loss == "orpo" else spec.cpo_alpha) * nll
        pair_sums["nll_loss"] = n * jax.lax.stop_gradient(nll)
    vocab_mean = jax.lax.stop_gradient(logits.astype(jnp.float32).mean(-1))  # (B, L-1)
    sg = jax.lax.stop_gradient
    aux = {
        "pairs": n,
        "rewards/chosen": (rewards[:, 0] * w).sum(),
        "rewards/rejected": (rewards[:, 1] * w).sum(),
        "rewards/accuracies": ((rewards[:, 0] > rewards[:, 1]) * w).sum(),
        "rewards/margins": ((rewards[:, 0] - rewards[:, 1]) * w).sum(),
        "logps/chosen": (sg(reported[:, 0]) * w).sum(),
        "logps/rejected": (sg(reported[:, 1]) * w).sum(),
        "logits_sum/chosen": (vocab_mean * cmask * side).sum(),
        "logits_sum/rejected": (vocab_mean * cmask * (1 - side)).sum(),
        "tokens/chosen": (cmask * side).sum(),
        "tokens/rejected": (cmask * (1 - side)).sum(),
        **{k: sg(v) for k, v in pair_sums.items()},
    }
    return TokenSum(total, n), aux
