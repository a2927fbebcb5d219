"""Preference pairs packed into rows with document masks (`preference.packing`).

TRL's DPOTrainer `padding_free` (0.2x, disabled in 1.16 "after a refactor") flattens a
microbatch's chosen and rejected rows into one sequence whose `position_ids` restart per
row, so flash attention keeps each sequence to itself; the per-sequence log-probs, and the
loss, are the padded batch's. Here the same happens with fixed-length rows: the collated pairs
(`preference_data.collate`, truncated exactly as unpacked) are placed whole, best-fit
decreasing (`fsdp_jax.app.data.packing.fit`) by the pair's real tokens (chosen + rejected),
into rows of the unpacked row length L; a pair's chosen and rejected sit side by side in one
row, so any split of the batch (devices, microbatches) keeps a pair together.

A packed row: `tokens` (L,) int32, `completion` (L,) uint8 and `segment_ids` (L,) int32: pair
k of the row (0-based) is segment 2k + 1 (chosen) and 2k + 2 (rejected), 0 is padding.
Attention stays inside a segment and positions restart per segment (the SFT packing's
document mask, `fsdp_jax.app.data.packing`); the loss sums log-probs per segment
(`preference_packed`). A row holds at most `max_pairs` pairs: the segment ids' static bound,
`max_pairs_for(model.max_segments)` (a row's runs of ids, padding included, stay within
what cuDNN's packed layout is compiled for).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from fsdp_jax.app.data.packing import PackStats, fit
from fsdp_jax.errors import DataError

PACKED_KEYS = ("tokens", "completion", "segment_ids")


def max_pairs_for(max_segments: int) -> int:
    """Pairs per packed row: two segments each, plus one run of padding, within `max_segments`."""
    return max(1, (max_segments - 1) // 2)


@dataclasses.dataclass(frozen=True)
class PackedPairs:
    """Packed rows (R, L) and, per row, the pairs it holds: `pairs` (R, max_pairs) int64 indices
    into the collated pairs, -1 for an empty slot."""

    tokens: np.ndarray
    completion: np.ndarray
    segment_ids: np.ndarray
    pairs: np.ndarray
    stats: PackStats

    def __len__(self) -> int:
        return len(self.tokens)

    def rows(self, idx, ref_logps: np.ndarray | None = None) -> dict[str, np.ndarray]:
        """The batch of rows `idx`: tokens, completion, segment_ids (B, L); with `ref_logps` (the
        pairs' (P, 2) precomputed reference sums) also `ref_logps` (B, 2 x max_pairs), slot j of a
        row = segment j + 1 (0 in empty slots)."""
        out = {"tokens": self.tokens[idx], "completion": self.completion[idx], "segment_ids": self.segment_ids[idx]}
        if ref_logps is not None:
            pairs = self.pairs[idx]
            ref = np.where(pairs[..., None] >= 0, ref_logps[np.maximum(pairs, 0)], 0.0)  # (B, K, 2)
            out["ref_logps"] = ref.reshape(len(pairs), -1).astype(np.float32)
        return out

    def empty_rows(self, n: int) -> dict[str, np.ndarray]:
        """`n` rows without a pair (all padding): they fill an eval batch and count nothing."""
        length = self.tokens.shape[1]
        return {k: np.zeros((n, length), getattr(self, k).dtype) for k in PACKED_KEYS}


def pack_pairs(arrays: dict[str, np.ndarray], max_pairs: int, wheres: list[str] | None = None) -> PackedPairs:
    """Collated pairs (P, 2, L) -> `PackedPairs` of rows of L tokens. DataError (one line, naming
    the pair) when a pair's chosen and rejected together are longer than a row."""
    if max_pairs < 1:
        raise ValueError(f"max_pairs {max_pairs}: must be >= 1")
    lengths = arrays["attention"].sum(-1).astype(np.int64)  # (P, 2): real tokens (right-padded rows)
    length = arrays["tokens"].shape[-1]
    total = lengths.sum(-1)
    over = np.flatnonzero(total > length)
    if len(over):
        i = int(over[0])
        where = wheres[i] if wheres else f"pair {i}"
        raise DataError(
            f"{where}: the pair ({lengths[i, 0]} chosen + {lengths[i, 1]} rejected tokens) is longer than a "
            f"packed row ({length} tokens, data.seq_len + 1); raise data.seq_len, set preference.max_length "
            f"<= {length // 2}, or set preference.packing=false ({len(over)} such pairs)"
        )
    rows = [r[i : i + max_pairs] for r in fit(total.tolist(), length) for i in range(0, len(r), max_pairs)]
    n = len(rows)
    tokens = np.zeros((n, length), np.int32)
    completion = np.zeros((n, length), np.uint8)
    seg = np.zeros((n, length), np.int32)
    pairs = np.full((n, max_pairs), -1, np.int64)
    for r, members in enumerate(rows):
        at = 0
        for k, i in enumerate(members):
            pairs[r, k] = i
            for side in (0, 1):
                m = int(lengths[i, side])
                tokens[r, at : at + m] = arrays["tokens"][i, side, :m]
                completion[r, at : at + m] = arrays["completion"][i, side, :m]
                seg[r, at : at + m] = 2 * k + side + 1
                at += m
    stats = PackStats(examples=len(total), rows=n, real_tokens=int(total.sum()), row_tokens=n * length)
    return PackedPairs(tokens, completion, seg, pairs, stats)
