"""Packing examples into fixed-length rows, and the model batch of packed rows.

A packed row holds whole examples side by side: `tokens` (L,), `mask` (L,) (1 where
the token is a training target) and `segment` (L,) (1, 2, ... per example in the row;
0 = padding). `pack` places examples best-fit decreasing (each example, longest first,
goes into the fullest row it still fits; a new row when none has room), which on
ragged lengths fills rows to 95-99% (`PackStats.efficiency`). An example longer than a
row is truncated to one row or split into row-length pieces (`overflow`), counted.

`batch_from_rows` turns rows into what the model and loss read: inputs, targets (the
next token of the same example), weights (1 where that target is trained), segment
ids (attention stays inside a segment) and positions restarting at 0 per example
(RoPE). `batch_from_windows` does the same for pretraining windows with document
masks: a document ends at its EOS token.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

OVERFLOW = ("truncate", "split")
MAX_ROW_LEN = 1 << 24  # positions are int32 and a row is packed whole in memory; 16M tokens


def seg_dtype(row_len: int) -> np.dtype:
    """Segment ids' dtype for rows of `row_len` tokens: uint16 below 65536 tokens (an id is
    at most row_len // 2: a trained example has two tokens or more), else uint32."""
    return np.dtype(np.uint16 if row_len < 2**16 else np.uint32)


@dataclasses.dataclass
class PackStats:
    examples: int = 0  # examples packed (pieces of a split example count once)
    rows: int = 0
    real_tokens: int = 0  # tokens of examples placed in rows
    row_tokens: int = 0  # rows x row length
    truncated: int = 0  # examples cut to one row (overflow="truncate")
    split: int = 0  # examples cut into several rows' pieces (overflow="split")
    dropped_tokens: int = 0  # tokens cut off by truncation
    empty: int = 0  # examples with nothing to train on (skipped)

    @property
    def efficiency(self) -> float:
        """Real tokens / row tokens (1.0 = no padding)."""
        return self.real_tokens / self.row_tokens if self.row_tokens else 0.0

    def add(self, other: "PackStats") -> None:
        for f in dataclasses.fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))

    def as_dict(self) -> dict:
        return {**dataclasses.asdict(self), "efficiency": round(self.efficiency, 6)}


def fit(lengths: Sequence[int], row_len: int) -> list[list[int]]:
    """Best-fit decreasing: indices of `lengths` (each <= row_len) per row. Deterministic
    (ties broken by index)."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    rows: list[list[int]] = []
    free: list[tuple[int, int]] = []  # sorted (free space, row index)
    for i in order:
        n = lengths[i]
        if n > row_len or n <= 0:
            raise ValueError(f"example length {n} not in 1..{row_len}")
        k = bisect.bisect_left(free, (n, -1))
        if k == len(free):
            rows.append([i])
            r, space = len(rows) - 1, row_len - n
        else:
            space, r = free.pop(k)
            rows[r].append(i)
            space -= n
        if space > 0:
            bisect.insort(free, (space, r))
    return rows


def cut(
    tokens: np.ndarray, mask: np.ndarray, row_len: int, overflow: str, stats: PackStats
) -> list[tuple[np.ndarray, np.ndarray]]:
    """One example as pieces of at most row_len tokens that have something to train on
    (empty when nothing is left: counted in stats.empty)."""
    if overflow not in OVERFLOW:
        raise ValueError(f"overflow {overflow!r}: allowed {', '.join(OVERFLOW)}")
    pieces = [(tokens, mask)]
    if len(tokens) > row_len:
        if overflow == "truncate":
            stats.truncated += 1
            stats.dropped_tokens += len(tokens) - row_len
            pieces = [(tokens[:row_len], mask[:row_len])]
        else:
            stats.split += 1
            pieces = [(tokens[i : i + row_len], mask[i : i + row_len]) for i in range(0, len(tokens), row_len)]
    # a target needs a token before it in the same piece: mask[0] trains nothing
    pieces = [(t, m) for t, m in pieces if len(t) > 1 and m[1:].any()]
    if not pieces:
        stats.empty += 1
    return pieces


def pack(
    examples: Sequence[tuple[np.ndarray, np.ndarray]], row_len: int, dtype=np.int32
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(tokens (R, L) dtype, mask (R, L) uint8, segment (R, L) `seg_dtype(L)`: uint16, or
    uint32 for rows of 65536 tokens or more, long-context rows) for examples of (tokens,
    mask), each at most row_len long (see `cut`)."""
    if not 1 <= row_len <= MAX_ROW_LEN:
        raise ValueError(f"row length {row_len}: must be in 1..{MAX_ROW_LEN}")
    rows = fit([len(t) for t, _ in examples], row_len)
    tok = np.zeros((len(rows), row_len), dtype)
    msk = np.zeros((len(rows), row_len), np.uint8)
    seg = np.zeros((len(rows), row_len), seg_dtype(row_len))
    for r, members in enumerate(rows):
        at = 0
        for s, i in enumerate(members, 1):
            t, m = examples[i]
            tok[r, at : at + len(t)], msk[r, at : at + len(t)], seg[r, at : at + len(t)] = t, m, s
            at += len(t)
    return tok, msk, seg


def positions_from_segments(seg: np.ndarray) -> np.ndarray:
    """int32 positions restarting at 0 where the segment id changes (per row)."""
    seg = np.asarray(seg)
    idx = np.broadcast_to(np.arange(seg.shape[-1]), seg.shape)
    start = np.ones(seg.shape, bool)
    start[..., 1:] = seg[..., 1:] != seg[..., :-1]
    first = np.maximum.accumulate(np.where(start, idx, 0), axis=-1)
    return (idx - first).astype(np.int32)


def batch_from_rows(tokens: np.ndarray, mask: np.ndarray, seg: np.ndarray) -> dict[str, np.ndarray]:
    """The model batch of packed rows (B, L): inputs, targets, weights (float32), segment_ids,
    positions (int32). The target of position i is token i + 1 of the same example."""
    tokens, seg = tokens.astype(np.int32), seg.astype(np.int32)
    targets = np.zeros_like(tokens)
    targets[:, :-1] = tokens[:, 1:]
    same = np.zeros(tokens.shape, bool)
    same[:, :-1] = (seg[:, 1:] == seg[:, :-1]) & (seg[:, :-1] > 0)
    weights = np.zeros(tokens.shape, np.float32)
    weights[:, :-1] = mask[:, 1:]
    weights *= same
    return {
        "inputs": tokens,
        "targets": targets,
        "weights": weights,
        "segment_ids": seg,
        "positions": positions_from_segments(seg),
    }


def batch_from_windows(windows: np.ndarray, eos_id: int) -> dict[str, np.ndarray]:
    """Pretraining windows (B, S + 1) with document masks: a document ends with its EOS,
    so attention and positions restart after each EOS; every target is trained."""
    inputs = windows[:, :-1].astype(np.int32)
    ends = (inputs == eos_id).astype(np.int32)
    seg = 1 + np.cumsum(ends, axis=1) - ends  # the EOS belongs to the document it ends
    return {
        "inputs": inputs,
        "targets": windows[:, 1:].astype(np.int32),
        "weights": np.ones(inputs.shape, np.float32),
        "segment_ids": seg.astype(np.int32),
        "positions": positions_from_segments(seg),
    }
