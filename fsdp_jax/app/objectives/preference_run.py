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
import hashlib
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.app.data.examples import find_chat_template, special_tokens
from fsdp_jax.app.data.packed_rows import row_indices
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.app.data.windows import BatchIterator
from fsdp_jax.app.objectives.preference import PreferenceSpec, spec_problem
from fsdp_jax.app.objectives.preference_data import PairEncoder, PreferenceKeys, collate, read_pairs
from fsdp_jax.app.objectives.reference import reference_logps
from fsdp_jax.errors import ConfigError, DataError
from fsdp_jax.train.step import sharding_context

REF_FILE = "ref_logps.npz"  # precompute_ref_log_probs: the reference's (P, 2) log-prob sums, in the run dir


def is_preference(cfg) -> bool:
    return cfg.objective not in ("sft", "grpo")


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
def _load(files, tokenizer, keys, length, max_length, truncation):  # files: (path, mtime, size): a changed file reloads
    pairs, wheres, report = read_pairs([f for f, _, _ in files], _encoder(tokenizer), keys)
    arrays = collate(pairs, length, max_length=max_length, truncation=truncation, wheres=wheres, report=report)
    return arrays, report


def load_pairs(cfg) -> tuple[dict[str, np.ndarray], object]:
    """(collated pairs (P, 2, data.seq_len + 1), report) for the run; DataError / ConfigError
    on bad input (one line, nothing written). Token ids are checked against model.vocab_size."""
    c = cfg.preference
    keys = PreferenceKeys(c.prompt_key, c.chosen_key, c.rejected_key)
    length = cfg.data.seq_len + 1
    files = tuple((f, f.stat().st_mtime_ns, f.stat().st_size) for f in data_files(cfg.data.path))
    arrays, report = _load(files, c.tokenizer, keys, length, c.max_length or length, c.truncation)
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
    if cfg.preference.precompute_ref_log_probs:
        arrays = {**arrays, "ref_logps": load_ref_logps(cfg, arrays)}
    g = cfg.train.global_batch
    if g % process_count:
        raise DataError(f"global batch {g} is not divisible by {process_count} processes")
    per = g // process_count
    steps = _PairSteps(arrays, g, cfg.data.seed, slice(process_index * per, (process_index + 1) * per))
    return BatchIterator(steps), []


def fingerprint(arrays) -> str:
    """What the stored reference log-probs were computed over: the pairs' tokens and masks."""
    h = hashlib.sha256()
    for k in ("tokens", "completion"):
        h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()[:24]


def load_ref_logps(cfg, arrays) -> np.ndarray:
    """run_dir/ref_logps.npz's (P, 2) f32, checked against the dataset (DataError otherwise)."""
    f = Path(cfg.run_dir) / REF_FILE
    if not f.is_file():
        raise DataError(f"preference.precompute_ref_log_probs: {f} is missing (it is written before step 1)")
    with np.load(f) as z:
        ref, fp = z["ref_logps"], str(z["fingerprint"])
    if ref.shape != arrays["tokens"].shape[:2] or fp != fingerprint(arrays):
        raise DataError(
            f"preference.precompute_ref_log_probs: {f} does not match the dataset at data.path "
            f"({ref.shape[0]} pairs, fingerprint {fp}; the data has {arrays['tokens'].shape[0]}, "
            f"{fingerprint(arrays)}); delete it with the run's checkpoints, or restore the data"
        )
    return ref.astype(np.float32)


def precompute_ref_logps(cfg, model, plan, params, resumed: bool) -> None:
    """Write run_dir/ref_logps.npz from `params` (the starting weights) once, before step 1,
    in batches of train.global_batch pairs sharded like training; a resumed run finds it
    (and `load_ref_logps` checks it). Single process (process 0 computes and writes)."""
    arrays, _ = load_pairs(cfg)
    f = Path(cfg.run_dir) / REF_FILE
    if f.is_file() or resumed:
        load_ref_logps(cfg, arrays)
        return
    g, n = cfg.train.global_batch, len(arrays["tokens"])
    fn = jax.jit(
        lambda p, b: reference_logps(model, p, b),
        in_shardings=(plan.params, plan.batch),
        out_shardings=NamedSharding(plan.mesh, P()),
    )
    out = []
    with sharding_context(plan):
        for i in range(0, n, g):
            idx = np.arange(i, i + g) % n  # the last batch wraps around
            b = {k: jax.device_put(arrays[k][idx], plan.batch) for k in ("tokens", "completion")}
            out.append(np.asarray(jax.device_get(fn(params, b))))
    ref = np.concatenate(out)[:n].astype(np.float32)
    if jax.process_index() == 0:
        f.parent.mkdir(parents=True, exist_ok=True)
        tmp = f.with_suffix(".tmp.npz")
        np.savez(tmp, ref_logps=ref, fingerprint=np.asarray(fingerprint(arrays)))
        tmp.replace(f)
