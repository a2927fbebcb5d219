"""A preference run's pieces from its config: the spec, the reference, the pairs and their batches.

`objective` (dpo | ipo | hinge | simpo | orpo) with the `preference:` section; data.path is
a .jsonl / .parquet file or a `datasets` directory (or a directory of them) of
{prompt, chosen, rejected} rows (`preference_data`). Every row is read and tokenized once,
before anything is written (`load_pairs`, cached per process), and collated to rows of
data.seq_len + 1 tokens. Step s's global batch is `train.global_batch` pairs drawn by
`row_indices(seed, s)` (epochs reshuffled), a pure function of the step, so a resume
continues exactly; this process takes its contiguous share. With `preference.packing` the
collated pairs are packed into rows of the same length once (`preference_pack`), and
`train.global_batch` counts those rows.
"""

from __future__ import annotations

import functools
import hashlib
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.app.data.batches import global_batch
from fsdp_jax.app.data.examples import find_chat_template, special_tokens
from fsdp_jax.app.data.packed_rows import row_indices
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.app.data.windows import BatchIterator
from fsdp_jax.app.objectives.preference import PreferenceSpec, finish_metrics, spec_problem
from fsdp_jax.app.objectives.preference_data import PairEncoder, PreferenceKeys, collate, read_pairs
from fsdp_jax.app.objectives.preference_pack import PackedPairs, max_pairs_for, pack_pairs
from fsdp_jax.app.objectives.reference import reference_logps
from fsdp_jax.errors import ConfigError, DataError
from fsdp_jax.train.step import sharding_context

REF_FILE = "ref_logps.npz"  # precompute_ref_log_probs: the reference's (P, 2) log-prob sums, in the run dir
EVAL_REF_FILE = "eval_ref_logps.npz"  # the same over preference.eval_path's pairs


def is_preference(cfg) -> bool:
    return cfg.objective not in ("sft", "grpo")


def pair_rows(cfg) -> int:
    """Model rows per global-batch example: 2 for an unpacked pair (chosen and rejected rows),
    1 for a packed row (it holds its pairs' sequences) and for every other objective."""
    return 2 if is_preference(cfg) and not cfg.preference.packing else 1


def preference_spec(cfg) -> PreferenceSpec:
    """The run config's objective and `preference:` section as a `PreferenceSpec`
    (ConfigError naming the key when a value is out of range)."""
    c = cfg.preference
    spec = PreferenceSpec(cfg.objective, c.beta, c.label_smoothing, c.simpo_gamma, c.cpo_alpha)
    bad = spec_problem(spec)
    if bad:
        raise ConfigError("objective" if bad[0] == "loss" else f"preference.{bad[0]}", bad[1])
    return spec


def data_files(path: str, key: str = "data.path") -> list[Path]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(key, f"{path!r}: no such file or directory (preference rows: .jsonl, .parquet)")
    if p.is_file() or (p / "dataset_info.json").is_file() or (p / "state.json").is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.suffix in (".jsonl", ".parquet"))
    if not files:
        raise ConfigError(key, f"{path!r}: no .jsonl or .parquet files of preference rows in it")
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
    return arrays, report, wheres


@functools.lru_cache(maxsize=2)
def _pack(files, tokenizer, keys, length, max_length, truncation, max_pairs):
    arrays, _, wheres = _load(files, tokenizer, keys, length, max_length, truncation)
    return pack_pairs(arrays, max_pairs, wheres)


def _source(cfg, key: str):
    c = cfg.preference
    path = cfg.data.path if key == "data.path" else c.eval_path
    keys = PreferenceKeys(c.prompt_key, c.chosen_key, c.rejected_key)
    length = cfg.data.seq_len + 1
    files = tuple((f, f.stat().st_mtime_ns, f.stat().st_size) for f in data_files(path, key))
    return path, (files, c.tokenizer, keys, length, c.max_length or length, c.truncation)


def load_pairs(cfg, key: str = "data.path") -> tuple[dict[str, np.ndarray], object]:
    """(collated pairs (P, 2, data.seq_len + 1), report) for the run's `key` (data.path, or
    preference.eval_path: the held-out pairs, read and rendered the same way); DataError /
    ConfigError on bad input (one line, nothing written). Token ids are checked against
    model.vocab_size."""
    path, source = _source(cfg, key)
    arrays, report, _ = _load(*source)
    if cfg.preference.packing:  # a pair longer than a row: refused here, before anything is written
        _pack(*source, max_pairs_for(cfg.model.max_segments))
    hi = int(arrays["tokens"].max())
    if hi >= cfg.model.vocab_size:
        raise DataError(
            f"{key} {path!r}: token id {hi} is outside model.vocab_size={cfg.model.vocab_size} "
            "(preference.tokenizer does not match the model?)"
        )
    return arrays, report


def load_packed(cfg, key: str = "data.path") -> PackedPairs:
    """`load_pairs`'s pairs packed into rows (`preference.packing`; `preference_pack`)."""
    load_pairs(cfg, key)
    return _pack(*_source(cfg, key)[1], max_pairs_for(cfg.model.max_segments))


def packing_line(cfg) -> str:
    """What packing did to data.path's pairs: rows and efficiency (real tokens / row tokens),
    against one pair per two rows unpacked."""
    st, length = load_packed(cfg).stats, cfg.data.seq_len + 1
    unpacked = st.real_tokens / (2 * st.examples * length)
    return (
        f"packed {st.examples} pairs into {st.rows} rows of {length} tokens: efficiency {st.efficiency:.3f} "
        f"(unpacked {unpacked:.3f}, {2 * st.examples / st.rows:.2f}x fewer rows)"
    )


class _PairSteps:
    """`[step]` -> this process's pairs (or packed rows) of that step's global batch."""

    def __init__(self, n: int, fetch, global_batch: int, seed: int, mine: slice):
        self.n, self.fetch, self.global_batch, self.seed, self.mine = n, fetch, global_batch, seed, mine

    def __getitem__(self, step: int) -> dict[str, np.ndarray]:
        return self.fetch(row_indices(self.n, self.global_batch, self.seed, step)[self.mine])


def make_preference_batches(cfg, process_index: int, process_count: int) -> tuple[BatchIterator, list]:
    """(train iterator of pair batches (packed rows with `preference.packing`), this process's
    share of the held-out batches)."""
    arrays, _ = load_pairs(cfg)
    ref = load_ref_logps(cfg, arrays) if cfg.preference.precompute_ref_log_probs else None
    g = cfg.train.global_batch
    if g % process_count:
        raise DataError(f"global batch {g} is not divisible by {process_count} processes")
    per = g // process_count
    mine = slice(process_index * per, (process_index + 1) * per)
    if cfg.preference.packing:
        packed = load_packed(cfg)
        steps = _PairSteps(len(packed), lambda idx: packed.rows(idx, ref), g, cfg.data.seed, mine)
    else:
        arrays = arrays if ref is None else {**arrays, "ref_logps": ref}
        steps = _PairSteps(
            len(arrays["tokens"]), lambda idx: {k: v[idx] for k, v in arrays.items()}, g, cfg.data.seed, mine
        )
    return BatchIterator(steps), [{k: v[mine] for k, v in b.items()} for b in eval_batches(cfg)]


def eval_batches(cfg) -> list[dict[str, np.ndarray]]:
    """The held-out pairs (preference.eval_path) as global batches of train.global_batch pairs,
    in file order, at most train.eval_batches of them; the last batch wraps around to the
    first pairs (so every batch has the step's shape). None without eval_path or eval_every.
    Packed (`preference.packing`): batches of train.global_batch packed rows, the last filled
    with empty rows (which count no pair: every held-out pair is scored once)."""
    c = cfg.preference
    if not c.eval_path or not cfg.train.eval_every or not cfg.train.eval_batches:
        return []
    arrays, _ = load_pairs(cfg, "preference.eval_path")
    ref = None
    if c.precompute_ref_log_probs and preference_spec(cfg).needs_reference:
        ref = load_ref_logps(cfg, arrays, EVAL_REF_FILE)
    if c.packing:
        return _packed_eval(
            load_packed(cfg, "preference.eval_path"), ref, cfg.train.global_batch, cfg.train.eval_batches
        )
    arrays = arrays if ref is None else {**arrays, "ref_logps": ref}
    g, n = cfg.train.global_batch, len(arrays["tokens"])
    count = min(-(-n // g), cfg.train.eval_batches)
    return [{k: v[np.arange(i * g, (i + 1) * g) % n] for k, v in arrays.items()} for i in range(count)]


def _packed_eval(packed: PackedPairs, ref, g: int, most: int) -> list[dict[str, np.ndarray]]:
    out = []
    for start in range(0, min(len(packed), g * most), g):
        idx = np.arange(start, min(start + g, len(packed)))
        b = packed.rows(idx, ref)
        if len(idx) < g:
            fill = packed.empty_rows(g - len(idx))
            if ref is not None:
                fill["ref_logps"] = np.zeros((g - len(idx), b["ref_logps"].shape[1]), np.float32)
            b = {k: np.concatenate([v, fill[k]]) for k, v in b.items()}
        out.append(b)
    return out


def fingerprint(arrays) -> str:
    """What the stored reference log-probs were computed over: the pairs' tokens and masks."""
    h = hashlib.sha256()
    for k in ("tokens", "completion"):
        h.update(np.ascontiguousarray(arrays[k]).tobytes())
    return h.hexdigest()[:24]


def load_ref_logps(cfg, arrays, name: str = REF_FILE) -> np.ndarray:
    """run_dir/`name`'s (P, 2) f32, checked against the pairs `arrays` (DataError otherwise)."""
    f = Path(cfg.run_dir) / name
    key = "data.path" if name == REF_FILE else "preference.eval_path"
    if not f.is_file():
        raise DataError(f"preference.precompute_ref_log_probs: {f} is missing (it is written before step 1)")
    with np.load(f) as z:
        ref, fp = z["ref_logps"], str(z["fingerprint"])
    if ref.shape != arrays["tokens"].shape[:2] or fp != fingerprint(arrays):
        raise DataError(
            f"preference.precompute_ref_log_probs: {f} does not match the dataset at {key} "
            f"({ref.shape[0]} pairs, fingerprint {fp}; the data has {arrays['tokens'].shape[0]}, "
            f"{fingerprint(arrays)}); delete it with the run's checkpoints, or restore the data"
        )
    return ref.astype(np.float32)


def precompute_ref_logps(cfg, model, plan, params, resumed: bool) -> None:
    """Write run_dir/ref_logps.npz (and eval_ref_logps.npz for preference.eval_path's pairs)
    from `params` (the starting weights) once, before step 1, in batches of
    train.global_batch pairs sharded like training; a resumed run finds them (and
    `load_ref_logps` checks them). Single process (process 0 computes and writes)."""
    fn = jax.jit(
        lambda p, b: reference_logps(model, p, b),
        in_shardings=(plan.params, plan.batch),
        out_shardings=NamedSharding(plan.mesh, P()),
    )
    sources = [(REF_FILE, "data.path")]
    if cfg.preference.eval_path and cfg.train.eval_every and cfg.train.eval_batches:
        sources.append((EVAL_REF_FILE, "preference.eval_path"))
    for name, key in sources:
        arrays, _ = load_pairs(cfg, key)
        f = Path(cfg.run_dir) / name
        if f.is_file() or resumed:
            load_ref_logps(cfg, arrays, name)
            continue
        g, n = cfg.train.global_batch, len(arrays["tokens"])
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


def evaluate_pairs(run, params, batches, model_state=None) -> dict[str, float]:
    """The held-out pairs' metrics under TRL's eval names: `eval_loss` (the mean of the
    batches' losses) and `eval_rewards/chosen`, `eval_rewards/accuracies`, ... (`finish_metrics`
    over the batches, as the train records average microbatches)."""
    state = (model_state,) if run.plan.model_state is not None else ()
    outs = [run.eval_step(params, *state, global_batch(run.plan, b)) for b in batches]
    if outs and "loss_sum" in outs[0]:  # packed rows: a TokenSum over pairs, the mean over every pair
        loss = sum(float(o["loss_sum"]) for o in outs) / max(1.0, sum(float(o["tokens"]) for o in outs))
    else:
        loss = float(np.mean([float(o["loss"]) for o in outs]))
    rec = {"eval_loss": loss}
    rec.update({f"eval_{k}": v for k, v in finish_metrics([jax.device_get(o["aux"]) for o in outs]).items()})
    return rec
