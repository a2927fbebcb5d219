"""The batches `fsdp-jax verify` trains: the trainer's own when the config's corpus says how
they look, random tokens otherwise.

    batches, what = verify_batches(cfg, steps=3, seed=0, vocab_shrunk=False)

When `data.path` holds a packed fine-tuning corpus (meta.json `"format": "packed"`), or a
token corpus with `data.document_mask: true`, the batches are the first `steps` steps'
batches of the train split exactly as the trainer reads them (`fsdp_jax.app.data.batches`): dicts of
inputs, targets, segment ids, positions and loss weights, so verify compiles and compares
the masked, per-segment step with the global token mean the trainer runs. When verify shrank
the model (`vocab_shrunk`), token ids are folded into the smaller vocab (`id % vocab_size`);
the segments, positions and weights, which are what the packed step's sharding depends on,
stay. Without such a corpus: `(global_batch, seq_len + 1)` random int32 tokens, as before.
A GRPO config (`objective: grpo`): `grpo_batches`, GRPO batches of the trainer's shapes.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np

from fsdp_jax.app.data.batches import check_tokens, make_batches
from fsdp_jax.app.objectives.grpo_run import grpo_batch, is_grpo
from fsdp_jax.app.objectives.preference_run import is_preference, make_preference_batches


def _corpus_kind(cfg) -> str | None:
    """ "packed", "tokens" or None (no corpus at data.path)."""
    meta = Path(cfg.data.path) / "meta.json"
    if not meta.is_file():
        return None
    try:
        return "packed" if json.loads(meta.read_text()).get("format") == "packed" else "tokens"
    except ValueError:
        return None


def grpo_batches(cfg, steps: int, seed: int) -> list[dict]:
    """`steps` random GRPO batches (`grpo_batch`) from `seed`."""
    rng = np.random.default_rng(seed)
    return [grpo_batch(cfg, rng) for _ in range(steps)]


def verify_batches(cfg, steps: int, seed: int, vocab_shrunk: bool = False) -> tuple[list, str]:
    """(`steps` host batches, a note saying what they are); see the module docstring."""
    if is_preference(cfg):  # the trainer's pair batches (the reference's log-probs computed in the step)
        pref = dataclasses.replace(cfg.preference, precompute_ref_log_probs=False, eval_path=None)
        it, _ = make_preference_batches(dataclasses.replace(cfg, preference=pref), 0, 1)
        out = []
        for step in range(steps):
            b = {k: np.asarray(v) for k, v in next(it).items()}
            if vocab_shrunk:
                b["tokens"] = b["tokens"] % cfg.model.vocab_size
            out.append(b)
        return out, f"batches: the trainer's first {steps} batches of pairs of {cfg.data.path} {out[0]['tokens'].shape}"
    if is_grpo(cfg):
        g = cfg.grpo
        return grpo_batches(cfg, steps, seed), (
            f"batches: random GRPO rows ({cfg.train.global_batch} x {g.max_prompt_len} + {g.max_new_tokens} "
            "tokens, random prompt and completion lengths, normal advantages"
            + (", sampling log-probs" if g.num_iterations > 1 else "")
            + "): the GRPO loss"
        )
    kind = _corpus_kind(cfg)
    if kind == "packed" or (kind == "tokens" and cfg.data.document_mask):
        train = dataclasses.replace(cfg.train, eval_every=0)
        it, _ = make_batches(dataclasses.replace(cfg, train=train), 0, 1)
        vocab = cfg.model.vocab_size
        out = []
        for step in range(steps):
            b = {k: np.asarray(v) for k, v in next(it).items()}
            if vocab_shrunk:
                b["inputs"], b["targets"] = b["inputs"] % vocab, b["targets"] % vocab
            check_tokens(b, vocab, step, cfg.data.path)
            out.append(b)
        shape = tuple(out[0]["inputs"].shape)
        what = "packed rows" if kind == "packed" else "document-masked windows"
        fold = f", token ids mod {vocab} (shrunk vocab)" if vocab_shrunk else ""
        return out, (
            f"batches: the trainer's first {steps} {what} of {cfg.data.path} {shape} "
            f"(segment ids, positions, loss weights; the global token-mean loss){fold}"
        )
    rng = np.random.default_rng(seed)
    shape = (cfg.train.global_batch, cfg.data.seq_len + 1)
    return [rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32) for _ in range(steps)], (
        f"batches: random tokens {shape}"
    )
