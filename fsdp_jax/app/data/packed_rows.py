"""A packed fine-tuning corpus (`fsdp_jax.app.data.sft`) read back as resumable batches.

Batches: the rows of step s are a pure function of (seed, s): global row slot
g = s * global_batch + r is row perm_e[g mod n] of epoch e = g // n, perm_e a
permutation drawn from (seed, e). Each process takes its slice of the global batch's
rows, so 1 or N processes see the same global batch, and a run resumes at any step on
any number of processes.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import grain
import numpy as np

from fsdp_jax.app.data.packing import batch_from_rows
from fsdp_jax.app.data.windows import NEVER_ENDS, BatchIterator, load_meta, process_rows, seg_dtype_of
from fsdp_jax.errors import DataError

_STREAM = {"train": 3, "val": 4}


class PackedRows:
    """Read-only memmaps of one split's rows; pickles by path (for grain workers)."""

    def __init__(self, data_dir: str | os.PathLike, split: str):
        meta = load_meta(data_dir)
        if meta.get("format") != "packed":
            raise DataError(
                f"{str(data_dir)!r}: not a packed corpus (prepare it with scripts/prepare.py --pack ROW_LEN)"
            )
        self.data_dir, self.split, self.row_len = str(data_dir), split, meta["row_len"]
        d = Path(data_dir)
        self.tokens = np.memmap(d / f"{split}.bin", meta["dtype"], "r").reshape(-1, self.row_len)
        self.mask = np.memmap(d / f"{split}.mask.bin", np.uint8, "r").reshape(-1, self.row_len)
        self.seg = np.memmap(d / f"{split}.seg.bin", seg_dtype_of(meta), "r").reshape(-1, self.row_len)

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, rows: np.ndarray) -> dict[str, np.ndarray]:
        return batch_from_rows(self.tokens[rows], self.mask[rows], self.seg[rows])

    def __getstate__(self):
        return {"data_dir": self.data_dir, "split": self.split}

    def __setstate__(self, state):
        self.__init__(state["data_dir"], state["split"])


@functools.lru_cache(maxsize=4)
def _epoch_perm(n: int, seed: int, stream: int, epoch: int) -> np.ndarray:
    return np.random.default_rng([seed, stream, epoch]).permutation(n)


def row_indices(n_rows: int, global_batch: int, seed: int, step: int, stream: int = _STREAM["train"]) -> np.ndarray:
    """The global batch of step `step`: row indices, a pure function of (seed, step)."""
    g = step * global_batch + np.arange(global_batch)
    epoch, slot = np.divmod(g, n_rows)
    out = np.empty(global_batch, np.int64)
    for e in np.unique(epoch):
        sel = epoch == e
        out[sel] = _epoch_perm(n_rows, seed, stream, int(e))[slot[sel]]
    return out


def _packed_at(step: int, *, rows: PackedRows, global_batch: int, seed: int, mine: slice):
    return rows.batch(row_indices(len(rows), global_batch, seed, step)[mine])


def make_packed_dataset(
    data_dir: str | os.PathLike,
    split: str,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> BatchIterator:
    """An iterator of this process's rows of each step's global batch, as
    `batch_from_rows` dicts of (global_batch // process_count, row_len)."""
    rows = PackedRows(data_dir, split)
    fn = functools.partial(
        _packed_at,
        rows=rows,
        global_batch=global_batch,
        seed=seed,
        mine=process_rows(global_batch, process_index, process_count),
    )
    return BatchIterator(grain.MapDataset.range(NEVER_ENDS).map(fn))


def packed_eval_batches(
    data_dir: str | os.PathLike, batch: int, n_batches: int, process_index: int = 0, process_count: int = 1
) -> list[dict]:
    """Every val row once (at most n_batches x batch), in order, this process's slice of each
    batch; the last batch is filled with rows of zero weight. Summing loss and trained
    tokens over them gives the example-level val loss of the held-out examples."""
    rows = PackedRows(data_dir, "val")
    mine = process_rows(batch, process_index, process_count)
    n = min(len(rows), n_batches * batch)
    out = []
    for start in range(0, n, batch):
        idx = np.arange(start, start + batch)
        b = rows.batch(np.minimum(idx, len(rows) - 1))
        b["weights"][idx >= n] = 0.0
        out.append({k: v[mine] for k, v in b.items()})
    return out
