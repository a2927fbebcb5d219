"""Does the corpus fit the model? Every token id in train.bin and val.bin must be below
`model.vocab_size`, checked once before a run writes anything or compiles.

An id outside the vocabulary would otherwise show up only as a NaN loss (the embedding
lookup fills it) batch by batch, after `config.yaml` is written and the step compiled.
The corpus's largest id comes from its `meta.json` (`max_token_id`, recorded when
scripts/prepare.py writes the corpus); a corpus prepared before that key existed is
scanned once (memory-mapped, in chunks; a tqdm bar when it is large).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fsdp_jax.app.data.windows import SPLITS, load_meta
from fsdp_jax.errors import DataError

META_KEY = "max_token_id"
CHUNK = 1 << 24  # tokens per max() over the memmap (32-64 MB)
BAR_FROM = 1 << 27  # tokens: scans of more show a progress bar (~0.1 s per 2**24)


def scan_max_token_id(data_dir: str | os.PathLike, dtype, progress: bool = False) -> tuple[int, str]:
    """(largest id, the split holding it) over every split of the corpus, read in chunks."""
    d = Path(data_dir)
    files = {
        s: np.memmap(d / f"{s}.bin", dtype=np.dtype(dtype), mode="r") for s in SPLITS if (d / f"{s}.bin").stat().st_size
    }
    total = sum(len(t) for t in files.values())
    bar = None
    if progress and total >= BAR_FROM:
        bar = tqdm(total=total, unit="tok", unit_scale=True, desc=f"checking token ids in {d}")
    best, where = -1, SPLITS[0]
    try:
        for split, tokens in files.items():
            for i in range(0, len(tokens), CHUNK):
                top = int(tokens[i : i + CHUNK].max())
                if top > best:
                    best, where = top, split
                if bar is not None:
                    bar.update(min(CHUNK, len(tokens) - i))
    finally:
        if bar is not None:
            bar.close()
    return best, where


def corpus_max_token_id(data_dir: str | os.PathLike, progress: bool = False) -> tuple[int, str]:
    """(largest token id of the corpus, where it was read: meta.json or a split's .bin).
    DataError when meta.json is missing or its `max_token_id` is not an id."""
    d = Path(data_dir)
    meta = load_meta(d)
    if META_KEY in meta:
        v = meta[META_KEY]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise DataError(f"{str(d / 'meta.json')!r}: invalid ({META_KEY} {v!r} is not a token id)")
        return v, "meta.json"
    top, split = scan_max_token_id(d, meta["dtype"], progress)
    return top, f"{split}.bin"


def check_corpus_vocab(data_dir: str | os.PathLike, vocab_size: int, progress: bool = False) -> None:
    """DataError (one line: the corpus, the id, the vocab size) unless every token id of the
    corpus at `data_dir` is < `vocab_size`."""
    top, where = corpus_max_token_id(data_dir, progress)
    if top >= vocab_size:
        raise DataError(
            f"data.path {str(data_dir)!r}: token id {top} ({where}) is outside "
            f"model.vocab_size={vocab_size}; the corpus does not match the model "
            "(prepared with another tokenizer, or its meta.json vocab_size is wrong?)"
        )
