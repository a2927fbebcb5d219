"""The train and val splits of a packed fine-tuning corpus, written as examples come
(`fsdp_jax.app.data.sft.prepare_examples` feeds them).

    splits = PackedSplits(out, row_len=512, dtype=np.uint16, overflow="truncate", seed=0,
                          val_fraction=0.05, pack_tokens=1 << 21)
    splits.add_examples(items, examples); splits.close(); splits.tmp_files()

Example i (counted over the sources in order) goes to val when a hash of (seed, i) falls
below `val_fraction`. Each split (`SplitWriter`) buffers its examples, packs them a
buffer at a time (best-fit decreasing, `fsdp_jax.app.data.packing`) and appends the rows to
temporary files `.<split>.{bin,mask.bin,seg.bin}.tmp.<pid>` in `out`; memory is bounded
by the buffer, not the corpus. `PackedSplits` also counts the examples by kind and
remembers the first one with nothing to train on.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fsdp_jax.app.data.packing import PackStats, batch_from_rows, cut, pack


def _held_out(seed: int, index: np.ndarray, fraction: float) -> np.ndarray:
    """splitmix64 of (seed, example index) < fraction: the val examples."""
    with np.errstate(over="ignore"):
        z = index.astype(np.uint64) + np.uint64(0x9E3779B97F4A7C15) * np.uint64(seed + 1)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    return (z >> np.uint64(11)).astype(np.float64) / 2.0**53 < fraction


class SplitWriter:
    """Buffers one split's examples, packs them a buffer at a time (when `pack_tokens`, and
    at least 256 rows' worth, are buffered), appends the rows."""

    FILES = ("bin", "mask.bin", "seg.bin")

    def __init__(self, out: Path, split: str, row_len: int, dtype, overflow: str, pack_tokens: int):
        self.row_len, self.dtype, self.overflow = row_len, dtype, overflow
        self.tmp = {f"{split}.{k}": out / f".{split}.{k}.tmp.{os.getpid()}" for k in self.FILES}
        self.fh = [open(p, "wb") for p in self.tmp.values()]
        self.buf: list[tuple[np.ndarray, np.ndarray]] = []
        self.buffered = 0
        self.stats = PackStats()
        self.trained = 0
        self.max_token = -1
        self.limit = max(pack_tokens, 256 * row_len)

    def add(self, tokens: np.ndarray, mask: np.ndarray) -> None:
        for t, m in cut(tokens, mask, self.row_len, self.overflow, self.stats):
            self._piece(t, m)

    def add_stream(self, chunks) -> None:
        """One plain example (every token trained) given as token arrays in order, never
        whole in memory: the pieces `add` would make of their concatenation, in order."""
        n, kept, carry, L = 0, 0, np.zeros(0, np.int32), self.row_len
        for c in chunks:
            n += len(c)
            if self.overflow == "truncate":  # keep the first row, count the rest
                if len(carry) < L:
                    carry = np.concatenate([carry, c[: L - len(carry)]])
                continue
            carry = np.concatenate([carry, c])
            full = len(carry) // L * L
            for i in range(0, full, L):
                kept += self._keep(carry[i : i + L])
            carry = carry[full:]
        kept += self._keep(carry)
        if n > L:
            if self.overflow == "truncate":
                self.stats.truncated += 1
                self.stats.dropped_tokens += n - L
            else:
                self.stats.split += 1
        if not kept:
            self.stats.empty += 1

    def _keep(self, tokens: np.ndarray) -> int:
        if len(tokens) <= 1:  # a target needs a token before it in the same piece (`cut`)
            return 0
        self._piece(tokens.astype(np.int32), np.ones(len(tokens), np.uint8))
        return 1

    def _piece(self, tokens: np.ndarray, mask: np.ndarray) -> None:
        self.buf.append((tokens, mask))
        self.buffered += len(tokens)
        if self.buffered >= self.limit:  # per piece: a long example never fills memory
            self.flush()

    def flush(self) -> None:
        if not self.buf:
            return
        tok, msk, seg = pack(self.buf, self.row_len, self.dtype)
        for fh, arr in zip(self.fh, (tok, msk, seg)):
            arr.tofile(fh)
        real = sum(len(t) for t, _ in self.buf)
        self.stats.add(PackStats(examples=len(self.buf), rows=len(tok), real_tokens=real, row_tokens=tok.size))
        self.trained += int(batch_from_rows(tok, msk, seg)["weights"].sum())
        self.max_token = max(self.max_token, int(tok.max()))
        self.buf, self.buffered = [], 0

    def close(self) -> None:
        self.flush()
        for fh in self.fh:
            fh.close()

    def discard(self) -> None:
        for fh in self.fh:
            fh.close()
        for p in self.tmp.values():
            p.unlink(missing_ok=True)


class PackedSplits:
    """The train and val `SplitWriter`s of one corpus, and the tally of its examples
    (`index`: examples so far, `kinds`: per kind, `first_empty`: "file:line" of the first
    example with an empty loss mask, or None; `dropped`: chat examples whose template left
    some message text out, `first_dropped` the first's "file:line")."""

    def __init__(self, out: Path, row_len: int, dtype, overflow: str, seed: int, val_fraction: float, pack_tokens: int):
        self.writers = {s: SplitWriter(out, s, row_len, dtype, overflow, pack_tokens) for s in ("train", "val")}
        self.seed, self.val_fraction = seed, val_fraction
        self.kinds: dict[str, int] = {}
        self.first_empty: str | None = None
        self.index = 0
        self.dropped, self.first_dropped = 0, None
        self.first_truncated: str | None = None

    def add_stream(self, chunks, where: str) -> None:
        """One plain example given as token arrays in order (a long text file, `where`)."""
        held_out = _held_out(self.seed, np.arange(self.index, self.index + 1), self.val_fraction)[0]
        w = self.writers["val" if held_out else "train"]
        before, cut = w.stats.empty, w.stats.truncated
        w.add_stream(chunks)
        self.kinds["plain"] = self.kinds.get("plain", 0) + 1
        if w.stats.empty > before and self.first_empty is None:
            self.first_empty = where
        if w.stats.truncated > cut and self.first_truncated is None:
            self.first_truncated = where
        self.index += 1

    def add_examples(self, items, examples) -> None:
        """Encoded `examples` of the (record, "file:line") `items`, in order."""
        val = _held_out(self.seed, np.arange(self.index, self.index + len(examples)), self.val_fraction)
        for (rec, where), ex, v in zip(items, examples, val):
            self.kinds[ex.kind] = self.kinds.get(ex.kind, 0) + 1
            if ex.dropped:
                self.dropped += 1
                self.first_dropped = self.first_dropped or where
            w = self.writers["val" if v else "train"]
            before, cut = w.stats.empty, w.stats.truncated
            w.add(ex.tokens, ex.mask)
            if w.stats.empty > before and self.first_empty is None:
                self.first_empty = where
            if w.stats.truncated > cut and self.first_truncated is None:
                self.first_truncated = where
        self.index += len(examples)

    def close(self) -> None:
        """Packs what is buffered and closes the files (they stay, to be committed)."""
        for w in self.writers.values():
            w.close()

    def discard(self) -> None:
        """Closes and removes the temporary files still there."""
        for w in self.writers.values():
            w.discard()

    def tmp_files(self) -> dict[str, Path]:
        """{final file name: its temporary file} of both splits."""
        return {name: p for w in self.writers.values() for name, p in w.tmp.items()}
