"""Reading a token corpus: its `meta.json` checked against the bins (`load_meta`), and
random windows of `seq_len + 1` tokens as a resumable, per-process Grain batch pipeline
(`make_dataset`, `eval_batches`).

Offsets are drawn from `(seed, step)` alone: the batch for step s is the same however
the iterator got there, so restoring `{"step": s}` resumes exactly. Each process builds
the same global offsets and reads only its rows, so the process slices, concatenated in
process order, are the single-process global batch. Writing a corpus is
`fsdp_jax.app.data.corpus`, which re-exports these names.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path

import grain
import numpy as np

from fsdp_jax.errors import DataError

SPLITS = ("train", "val")
_STREAM = {"train": 0, "val": 1, "eval": 2}  # keeps the splits' random offsets independent
NEVER_ENDS = 2**62  # grain needs a length; steps never reach it


def load_meta(data_dir: str | os.PathLike) -> dict:
    """meta.json of a complete corpus; DataError if missing or if the bins do not match it."""
    d = Path(data_dir)
    try:
        meta = json.loads((d / "meta.json").read_text())
        dt = np.dtype(meta["dtype"])
        if dt not in (np.uint16, np.uint32):
            raise ValueError(f"dtype {meta['dtype']!r}: allowed uint16, uint32")
        expect = {f"{s}.bin": (meta[f"{s}_tokens"], dt) for s in SPLITS}
        if meta.get("format") == "packed":  # fsdp_jax.app.data.sft: per-token mask and segment files
            seg = np.dtype(seg_dtype_of(meta))
            for s in SPLITS:
                expect[f"{s}.mask.bin"] = (meta[f"{s}_tokens"], np.dtype(np.uint8))
                expect[f"{s}.seg.bin"] = (meta[f"{s}_tokens"], seg)
    except FileNotFoundError:
        raise DataError(f"{str(d)!r}: meta.json not found; prepare it with scripts/prepare.py --out {d}") from None
    except (ValueError, KeyError, TypeError) as e:
        raise DataError(f"{str(d / 'meta.json')!r}: invalid ({e})") from None
    for name, (n, t) in expect.items():
        f = d / name
        if not f.is_file() or f.stat().st_size != n * t.itemsize:
            raise DataError(
                f"{str(f)!r}: missing or not {n} {t.name} values as meta.json says; prepare the corpus again"
            )
    return meta


def seg_dtype_of(meta: dict) -> str:
    """A packed corpus' segment-id dtype: meta.json's `seg_dtype` (uint16 or uint32, written
    since rows may hold 65536 tokens or more), uint16 for corpora written before it."""
    seg = meta.get("seg_dtype", "uint16")
    if seg not in ("uint16", "uint32"):
        raise ValueError(f"seg_dtype {seg!r}: allowed uint16, uint32")
    return seg


class TokenFile:
    """Read-only memmap of one split; pickles by path (for grain workers)."""

    def __init__(self, path: str | os.PathLike, dtype: str | np.dtype):
        self.path, self.dtype = Path(path), np.dtype(dtype)
        self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")

    @classmethod
    def open(cls, data_dir: str | os.PathLike, split: str) -> "TokenFile":
        if split not in SPLITS:
            raise DataError(f"split {split!r}: allowed {', '.join(SPLITS)}")
        return cls(Path(data_dir) / f"{split}.bin", load_meta(data_dir)["dtype"])

    def __len__(self) -> int:
        return len(self.tokens)

    def windows(self, starts: np.ndarray, length: int) -> np.ndarray:
        """int32 array (len(starts), length) of tokens[s : s + length] per start."""
        return self.tokens[np.asarray(starts)[:, None] + np.arange(length)].astype(np.int32)

    def __getstate__(self):
        return {"path": self.path, "dtype": self.dtype}

    def __setstate__(self, state):
        self.__init__(state["path"], state["dtype"])


def _starts(n_tokens: int, length: int, count: int, *entropy: int) -> np.ndarray:
    if n_tokens < length:
        raise DataError(
            f"split has {n_tokens} tokens, fewer than one window of {length} "
            "(seq_len + 1); use a shorter data.seq_len or a larger corpus"
        )
    return np.random.default_rng(list(entropy)).integers(0, n_tokens - length + 1, size=count)


def process_rows(global_batch: int, process_index: int, process_count: int) -> slice:
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} / process_count {process_count}: invalid")
    if global_batch % process_count:
        raise DataError(f"global batch {global_batch} is not divisible by {process_count} processes")
    per = global_batch // process_count
    return slice(process_index * per, (process_index + 1) * per)


def _batch_at(
    step: int, *, tokens: TokenFile, seq_len: int, global_batch: int, seed: int, stream: int, rows: slice
) -> np.ndarray:
    starts = _starts(len(tokens), seq_len + 1, global_batch, seed, stream, step)
    return tokens.windows(starts[rows], seq_len + 1)


class BatchIterator:
    """Iterator over a grain MapDataset indexed by step; state is {"step": next step}.

    `__next__` returns int32 (per_process_batch, seq_len + 1); inputs are [:, :-1],
    targets [:, 1:].
    """

    def __init__(self, dataset: grain.MapDataset, step: int = 0):
        self.dataset, self.step = dataset, step

    def __iter__(self) -> "BatchIterator":
        return self

    def __next__(self) -> np.ndarray:
        batch = self.dataset[self.step]
        self.step += 1
        return batch

    def batch(self, step: int) -> np.ndarray:
        """The batch of any step, without moving the iterator."""
        return self.dataset[step]

    def get_state(self) -> dict:
        return {"step": self.step}

    def set_state(self, state: dict) -> None:
        step = state.get("step") if isinstance(state, dict) else None
        if not isinstance(step, int) or isinstance(step, bool) or step < 0:
            raise DataError(f"data iterator state {state!r}: expected {{'step': int >= 0}}")
        self.step = step


def make_dataset(
    data_dir: str | os.PathLike,
    split: str,
    seq_len: int,
    global_batch: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> BatchIterator:
    """Random windows from `split`: an iterator of int32 (global_batch // process_count,
    seq_len + 1), this process's rows of the global batch of each step."""
    tokens = TokenFile.open(data_dir, split)
    rows = process_rows(global_batch, process_index, process_count)
    _starts(len(tokens), seq_len + 1, 0)  # fail now, not at the first batch
    fn = functools.partial(
        _batch_at,
        tokens=tokens,
        seq_len=seq_len,
        global_batch=global_batch,
        seed=seed,
        stream=_STREAM[split],
        rows=rows,
    )
    return BatchIterator(grain.MapDataset.range(NEVER_ENDS).map(fn))


def eval_batches(
    data_dir: str | os.PathLike,
    seq_len: int,
    batch: int,
    n_batches: int,
    seed: int,
    process_index: int = 0,
    process_count: int = 1,
) -> list[np.ndarray]:
    """A fixed, deterministic set of `n_batches` val batches, each int32
    (batch // process_count, seq_len + 1) (this process's rows)."""
    tokens = TokenFile.open(data_dir, "val")
    rows = process_rows(batch, process_index, process_count)
    starts = _starts(len(tokens), seq_len + 1, n_batches * batch, seed, _STREAM["eval"])
    return [tokens.windows(s[rows], seq_len + 1) for s in starts.reshape(n_batches, batch)]
