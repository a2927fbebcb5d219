"""Multi-token prediction's loss and metric (DeepSeek-V3 technical report, sec. 2.2, eq. 24-25).

    L_MTP^k = mean over the positions i that have token t_{i+k+1} of CE(logits^k_i, t_{i+k+1})
    L = L_main + mtp_loss_weight * (1 / D) * sum_k L_MTP^k

Depth k's logits come from the decoder's `mtp=True` call (`models/mtp.py`), row i predicting
the target k rows later. A row whose shifted target lies past the sequence, outside its packed
document (another segment id) or has weight 0 is left out. The step's aux carries `mtp_loss`
(the mean over depths, before the weight), logged per window into metrics.jsonl as MaxText
logs its `mtp_loss`. MaxText's `mtp_loss_scaling_factor` and Megatron's `mtp_loss_scaling_factor`
are this weight; DeepSeek-V3 used 0.3 for its first 10T tokens and 0.1 after.
"""

from __future__ import annotations

import jax.numpy as jnp
import optax

from fsdp_jax.app.models.mtp import shift_left
from fsdp_jax.train.step_parts import TokenSum


def depth_mask(b: dict, k: int):
    """(B, S) float32: which rows of depth k have a target (`b`: the step's model inputs)."""
    t = b["targets"]
    s = t.shape[1]
    valid = jnp.broadcast_to((jnp.arange(s) < s - k)[None, :], t.shape).astype(jnp.float32)
    if b["weights"] is not None:
        valid = valid * shift_left(b["weights"].astype(jnp.float32), k)
    if b["segment_ids"] is not None:  # t_{i+k} and its target in row i's document
        valid = valid * (shift_left(b["segment_ids"], k, -1) == b["segment_ids"])
    return valid


def mtp_loss(mtp_logits, b: dict):
    """The mean over depths of each depth's mean cross-entropy (float32 scalar)."""
    losses = []
    for k, logits in enumerate(mtp_logits, start=1):
        w = depth_mask(b, k)
        ce = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), shift_left(b["targets"], k))
        losses.append((ce * w).sum() / jnp.maximum(w.sum(), 1.0))
    return jnp.mean(jnp.stack(losses))


def add_term(main, extra):
    """`main` (a mean loss or a `TokenSum`) plus `extra`, a mean over the batch (a TokenSum's
    total gains extra x its count, so the step's division leaves `extra`)."""
    if isinstance(main, TokenSum):
        return TokenSum(main.total + extra * main.count, main.count)
    return main + extra


def with_mtp(cfg, main, out, b: dict):
    """(main loss + the weighted MTP loss, {"mtp_loss": L_MTP}) from the decoder's `mtp=True`
    output's depth logits `out`."""
    m = mtp_loss(out, b)
    return add_term(main, cfg.mtp_loss_weight * m), {"mtp_loss": m}
