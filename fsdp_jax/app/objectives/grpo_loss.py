"""The GRPO loss as the train step calls it, with its reference model.

A GRPO batch (B rows = prompts x G): `tokens` (B, P + N) int32, each row its prompt then its
completion, right-padded (no left padding in training: plain causal attention, any kernel);
`prompt_len` (B,) int32; `completion` (B, N) int32 and `completion_mask` (B, N) (1 up to and
including a row's stop token); `advantages` (B,) f32; optional `old_logps` (B, N) f32 (the
sampling policy's, needed when `num_iterations` > 1) and `ref_logps` (B, N) (precomputed).

The reference (`fsdp_jax.app.objectives.reference.REFERENCES`) is the frozen starting
weights in model state (`state`), the LoRA base with adapters off (`adapters_off`), or none
(beta = 0: no reference forward at all).
"""

from __future__ import annotations

from typing import Callable

import jax

from fsdp_jax.app.objectives.grpo import GrpoSpec, completion_logits, completion_logps, grpo_terms
from fsdp_jax.app.objectives.reference import REFERENCES, adapters_off
from fsdp_jax.model.fns import ModelFns


def choose_grpo_reference(spec: GrpoSpec, lora: bool) -> str:
    """none when beta is 0, else the LoRA base (adapters off), else the frozen copy in model state."""
    if not spec.beta:
        return "none"
    return "adapters_off" if lora else "state"


def policy_logits(model: ModelFns, params, batch, key=None):
    """(B, N, V) logits scoring each row's completion tokens. The model reads the whole row,
    P + N tokens (the last one's logits go unused): rows of the width the user chose, which
    XLA:GPU tiles (8 x 1535 rows of Llama-3.1-8B's backward found no Triton GEMM tiling)."""
    kw = {} if key is None else {"dropout_key": key}
    return completion_logits(model.apply(params, batch["tokens"], **kw), batch)


def batch_logps(model: ModelFns, spec: GrpoSpec, params, batch):
    """(B, N) f32 log-probs of the completions under `params`, no gradient (old or reference)."""
    logps, _ = completion_logps(spec, policy_logits(model, jax.lax.stop_gradient(params), batch), batch["completion"])
    return jax.lax.stop_gradient(logps)


def make_grpo_loss(model: ModelFns, spec: GrpoSpec, reference: str) -> Callable:
    """`loss_fn(params, batch, state=None, rng=None, train=True)` for the train step (build
    with `has_aux=True`): `(loss, aux)`, or `((loss, aux), state)` when the reference is the
    model state (the state comes back as it was)."""
    if reference not in REFERENCES:
        raise ValueError(f"reference {reference!r}: one of {', '.join(REFERENCES)}")

    def loss_fn(params, batch, state=None, rng=None, train=True):
        logits = policy_logits(model, params, batch, rng if train else None)
        ref = None
        if reference == "precomputed":
            ref = batch["ref_logps"]
        elif reference == "state":
            ref = batch_logps(model, spec, state, batch)
        elif reference == "adapters_off":
            ref = batch_logps(model, spec, adapters_off(params), batch)
        out = grpo_terms(spec, logits, batch, ref)
        return (out, state) if reference == "state" else out

    return loss_fn
