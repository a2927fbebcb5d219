"""A preference run's pieces from its config: the spec, the reference, the pairs and their batches.

`objective` (dpo | ipo | hinge | simpo | orpo) with the `preference:` section; data.path is
a .jsonl / .parquet file or a `datasets` directory (or a directory of them) of
{prompt, chosen, rejected} rows (`preference_data`). Every row is read and tokenized once,
before anything is written (`load_pairs`, cached per process), and collated to rows of
data.seq_len + 1 tokens. Step s's global batch is `train.global_batch` pairs drawn by
`row_indices(seed, s)` (epochs reshuffled), a pure function of the step, so a resume
continues exactly; this process takes its contiguous share.
"""

from __future__ import annotations

import functools
from pathlib import Path

import numpy as np

from fsdp_jax.app.data.examples import find_chat_template, special_tokens
from fsdp_jax.app.data.packed_rows import row_indices
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.app.data.windows import BatchIterator
from fsdp_jax.app.objectives.preference import PreferenceSpec, spec_problem
from fsdp_jax.app.objectives.preference_data import PairEncoder, PreferenceKeys, collate, read_pairs
from fsdp_jax.errors import ConfigError, DataError


def is_preference(cfg) -> bool:
    return cfg.objective != "sft"


def preference_spec(cfg) -> PreferenceSpec:
    """The run config's objective and `preference:` section as a `PreferenceSpec`
    (ConfigError naming the key when a value is out of range)."""
    c = cfg.preference
    spec = PreferenceSpec(cfg.objective, c.beta, c.label_smoothing, c.simpo_gamma, c.cpo_alpha)
    bad = spec_problem(spec)
    if bad:
        raise ConfigError("objective" if bad[0] == "loss" else f"preference.{bad[0]}", bad[1])
    return spec


def data_files(path: str) -> list[Path]:
    p = Path(path)
    if not p.exists():
        raise ConfigError("data.path", f"{path!r}: no such file or directory (preference rows: .jsonl, .parquet)")
    if p.is_file() or (p / "dataset_info.json").is_file() or (p / "state.json").is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.suffix in (".jsonl", ".parquet"))
    if not files:
        raise ConfigError("data.path", f"{path!r}: no .jsonl or .parquet files of preference rows in it")
    return files


def _encoder(tokenizer: str | None) -> PairEncoder:
    if tokenizer is None:
        return PairEncoder()
    tok = load_tokenizer(tokenizer)
    return PairEncoder(tok, find_chat_template(tokenizer), special_tokens(tokenizer))


@functools.lru_cache(maxsize=2)
def _load(path, tokenizer, keys, length, max_length, truncation):
    pairs, wheres, report = read_pairs(data_files(path), _encoder(tokenizer), keys)
    arrays = collate(pairs, length, max_length=max_length, truncation=truncation, wheres=wheres, report=report)
    return arrays, report


def load_pairs(cfg) -> tuple[dict[str, np.ndarray], object]:
    """(collated pairs (P, 2, data.seq_len + 1), report) for the run; DataError / ConfigError
    on bad input (one line, nothing written). Token ids are checked against model.vocab_size."""
    c = cfg.preference
    keys = PreferenceKeys(c.prompt_key, c.chosen_key, c.rejected_key)
    length = cfg.data.seq_len + 1
    arrays, report = _load(cfg.data.path, c.tokenizer, keys, length, c.max_length or length, c.truncation)
    hi = int(arrays["tokens"].max())
    if hi >= cfg.model.vocab_size:
        raise DataError(
            f"data.path {cfg.data.path!r}: token id {hi} is outside model.vocab_size={cfg.model.vocab_size} "
            "(preference.tokenizer does not match the model?)"
        )
    return arrays, report


class _PairSteps:
    """`[step]` -> this process's pairs of that step's global batch."""

    def __init__(self, arrays, global_batch: int, seed: int, mine: slice):
        self.arrays, self.global_batch, self.seed, self.mine = arrays, global_batch, seed, mine

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        n = len(self.arrays["tokens"])
        idx = row_indices(n, self.global_batch, self.seed, step)[self.mine]
        return {k: v[idx] for k, v in self.arrays.items()}


def make_preference_batches(cfg, process_index: int, process_count: int) -> tuple[BatchIterator, list]:
    """(train iterator of pair batches, no val batches)."""
    arrays, _ = load_pairs(cfg)
    g = cfg.train.global_batch
    if g % process_count:
        raise DataError(f"global batch {g} is not divisible by {process_count} processes")
    per = g // process_count
    steps = _PairSteps(arrays, g, cfg.data.seed, slice(process_index * per, (process_index + 1) * per))
    return BatchIterator(steps), []
