"""The trainer's batches: the train iterator and validation batches for a run config,
their placement as global arrays, and the token-id check on each batch."""

from __future__ import annotations

import jax
import numpy as np

from fsdp_jax.app.data.packed_rows import make_packed_dataset, packed_eval_batches
from fsdp_jax.app.data.packing import batch_from_windows
from fsdp_jax.app.data.windows import eval_batches, load_meta, make_dataset
from fsdp_jax.errors import DataError
from fsdp_jax.sharding.strategy import ShardingPlan


def make_batches(cfg, process_index: int, process_count: int):
    """(train iterator, val batches) for the corpus at data.path: packed fine-tuning rows
    (`fsdp_jax.app.data.sft`), or windows of a token corpus (`fsdp_jax.app.data.corpus`), as
    batch dicts with document masks when data.document_mask."""
    c, meta = cfg.train, load_meta(cfg.data.path)
    n_val = c.eval_batches if c.eval_every else 0
    if meta.get("format") == "packed":
        batches = make_packed_dataset(
            cfg.data.path, "train", c.global_batch, cfg.data.seed, process_index, process_count
        )
        val = packed_eval_batches(cfg.data.path, c.global_batch, n_val, process_index, process_count) if n_val else []
        return batches, val
    batches = make_dataset(
        cfg.data.path, "train", cfg.data.seq_len, c.global_batch, cfg.data.seed, process_index, process_count
    )
    val = (
        eval_batches(
            cfg.data.path, cfg.data.seq_len, c.global_batch, n_val, cfg.data.seed, process_index, process_count
        )
        if n_val
        else []
    )
    if cfg.data.document_mask:
        eos = int(meta["eos_id"])
        batches.dataset = batches.dataset.map(lambda w: batch_from_windows(w, eos))
        val = [batch_from_windows(w, eos) for w in val]
    return batches, val


def global_batch(plan: ShardingPlan, local):
    """This process's rows (an array, or a packed batch dict) -> global arrays sharded
    over (data, fsdp)."""
    return jax.tree.map(lambda x: jax.make_array_from_process_local_data(plan.batch, x), local)


def check_tokens(local: np.ndarray, vocab_size: int, step: int, data_path: str) -> None:
    """A batch's token ids are in [0, vocab_size): an id outside would only show up as
    a NaN loss (the embedding lookup fills it), so name the data instead."""
    if isinstance(local, dict):
        local = local["inputs"] if "inputs" in local else local["tokens"]  # packed rows, or preference pairs
    lo, hi = int(local.min()), int(local.max())
    if lo < 0 or hi >= vocab_size:
        bad = hi if hi >= vocab_size else lo
        raise DataError(
            f"data.path {data_path!r}: step {step}'s batch holds token id {bad}, "
            f"outside model.vocab_size={vocab_size}; the corpus does not match "
            "the model (its meta.json vocab_size is wrong?)"
        )


def check_segments(local, max_segments: int, step: int, data_path: str) -> None:
    """Each packed row holds at most `max_segments` segments (runs of equal ids, padding
    included): the bound cuDNN's packed layout per ring block is compiled for
    (`model.max_segments`); a row over it would come out NaN and be skipped as non-finite."""
    if not isinstance(local, dict):
        return
    seg = np.asarray(local["segment_ids"])
    runs = 1 + np.count_nonzero(seg[:, 1:] != seg[:, :-1], axis=1)
    worst = int(runs.max(initial=0))
    if worst > max_segments:
        raise DataError(
            f"data.path {data_path!r}: step {step}'s batch has a row of {worst} segments (documents, "
            f"padding included), over model.max_segments={max_segments} that cuDNN's packed layout per "
            "ring block is sized for; raise model.max_segments or use model.attention=xla"
        )


def evaluate(run, params, batches, model_state=None) -> float:
    """Mean val loss: per token over all batches for packed / document-masked batches
    (sum of token losses / trained tokens: the example-level loss of held-out
    examples), else the mean of the batches' means. A model with state (FP8's amax
    histories) is evaluated with `model_state`."""
    state = (model_state,) if run.plan.model_state is not None else ()
    outs = [run.eval_step(params, *state, global_batch(run.plan, b)) for b in batches]
    if outs and "tokens" in outs[0]:
        return float(sum(float(o["loss_sum"]) for o in outs) / max(1.0, sum(float(o["tokens"]) for o in outs)))
    return float(np.mean([float(o["loss"]) for o in outs]))
