"""The preference loss as the train step calls it, with its reference model.

Where the reference log-probs come from (`REFERENCES`):

- `state`: the frozen starting weights ride in `TrainState.model_state` (`with_reference`):
  planned and sharded like the params at rest (`fsdp_jax.model.variables`), never
  differentiated, no optimizer state, checkpointed with the run (so a resume is exact);
  the step runs one extra forward over them, in the dtype they are stored in.
- `adapters_off`: under LoRA, the policy's own params with every `lora_b` zeroed (so
  x A 0 = 0 exactly): the frozen base, no second copy of the weights.
- `precomputed`: the batch carries `ref_logps` (P, 2) (`precompute_ref_log_probs`).
- `none`: a reference-free loss (simpo, orpo).
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp

from fsdp_jax.app.models.lora import is_adapter
from fsdp_jax.app.objectives.preference import PreferenceSpec, preference_terms, sequence_logps
from fsdp_jax.app.objectives.preference_packed import is_packed, packed_inputs, packed_reference_logps, packed_terms
from fsdp_jax.model.fns import ModelFns
from fsdp_jax.train.step_parts import TokenSum

REFERENCES = ("state", "adapters_off", "precomputed", "none")


def choose_reference(spec: PreferenceSpec, lora: bool, precomputed: bool = False) -> str:
    """The reference a run uses: none for reference-free losses, else precomputed when
    asked, else the LoRA base (adapters off), else the frozen copy in model state."""
    if not spec.needs_reference:
        return "none"
    if precomputed:
        return "precomputed"
    return "adapters_off" if lora else "state"


def with_reference(model: ModelFns, dtype=None) -> ModelFns:
    """`model` whose non-trainable state is a copy of its params (the reference): the same
    shapes and logical axes, initialised by the same init, so `init_state(rng)` equals
    `init(rng)`. With `dtype` (the run's compute dtype) its floating leaves are stored in
    that dtype (`reference_copy`): the reference's forward runs in the compute dtype anyway
    (`as_compute`), so a bf16-compute run keeps half an f32 copy, with the same log-probs to
    the bit. The decoder's `apply` is unchanged."""
    abstract, init = model.abstract_params, model.init
    if dtype is not None:
        abstract = reference_copy(abstract, dtype)
        init = lambda rng: reference_copy(model.init(rng), dtype)  # noqa: E731
    return dataclasses.replace(
        model, abstract_model_state=abstract, model_state_axes=model.logical_axes, init_state=init
    )


def reference_copy(params, dtype):
    """`params` (arrays or ShapeDtypeStructs) with their floating leaves in `dtype`: the
    reference's stored form."""

    def cast(x):
        if not jnp.issubdtype(x.dtype, jnp.floating):
            return x
        if isinstance(x, jax.ShapeDtypeStruct):
            return jax.ShapeDtypeStruct(x.shape, jnp.dtype(dtype), sharding=x.sharding)
        return x.astype(dtype)

    return jax.tree.map(cast, params)


def without_reference(model: ModelFns) -> ModelFns:
    """`model` as it was before `with_reference` (no model state): the policy's own function,
    e.g. for sampling text from it."""
    return dataclasses.replace(model, abstract_model_state=None, model_state_axes=None, init_state=None)


def adapters_off(params):
    """`params` with every adapter's `lora_b` zeroed: the base model's function."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: jnp.zeros_like(x) if is_adapter(path) and _last(path) == "lora_b" else x, params
    )


def _last(path) -> str:
    k = path[-1]
    return str(getattr(k, "key", getattr(k, "name", k)))


def pair_logits(model: ModelFns, params, batch, key=None, router: bool = False):
    """Logits (2P, L-1, V) of the batch's rows `tokens[..., :-1]`, pairs flattened (packed rows:
    (B, L-1, V), attention and positions per segment); with `router` (a mixture of experts)
    `(logits, router stats)`, the router seeing the real tokens only (`attention`, or a
    nonzero segment), as transformers' load-balancing loss with an attention mask."""
    kw = {} if key is None else {"dropout_key": key}
    if is_packed(batch):
        inputs, seg, pos = packed_inputs(batch)
        if router:
            return model.apply(params, inputs, seg, pos, router=True, token_mask=seg > 0, **kw)
        return model.apply(params, inputs, seg, pos, **kw)
    p = batch["tokens"].shape[0]
    inputs = batch["tokens"][..., :-1].reshape(2 * p, -1)
    if router:
        mask = batch["attention"][..., :-1].reshape(2 * p, -1) > 0
        return model.apply(params, inputs, None, None, router=True, token_mask=mask, **kw)
    return model.apply(params, inputs, **kw)


def as_compute(ref_params, params):
    """The reference's floating leaves in the dtype of the policy's matching leaves (the
    compute dtype the train step cast the policy to: bf16 compute runs the reference in bf16,
    as a fused attention kernel requires)."""
    return jax.tree.map(
        lambda r, p: r.astype(p.dtype) if jnp.issubdtype(r.dtype, jnp.floating) else r, ref_params, params
    )


def reference_logps(model: ModelFns, ref_params, batch, slots: int = 0):
    """(P, 2) completion log-prob sums under `ref_params` (no gradient flows); a packed batch's
    (B, `slots`) per segment (`preference_packed`)."""
    logits = pair_logits(model, jax.lax.stop_gradient(ref_params), batch)
    if is_packed(batch):
        return packed_reference_logps(logits, batch, slots)
    p = batch["tokens"].shape[0]
    targets = batch["tokens"][..., 1:].reshape(2 * p, -1)
    mask = batch["completion"][..., 1:].reshape(2 * p, -1)
    sums, _ = sequence_logps(logits, targets, mask)
    return jax.lax.stop_gradient(sums.reshape(p, 2))


def make_preference_loss(
    model: ModelFns, spec: PreferenceSpec, reference: str, router: Callable | None = None, slots: int = 0
) -> Callable:
    """`loss_fn(params, batch, state=None, rng=None, train=True)` for the train step (build
    with `has_aux=True`): returns `(loss, aux)`, or `((loss, aux), state)` when the
    reference is the model state (the step's extended call; the state comes back as it was).
    `router` (a mixture of experts): `router(stats) -> (terms, router aux)`
    (`fsdp_jax.app.trainer.router_metrics.router_terms`): the policy's load-balancing and z
    terms are added to the loss, as TRL adds `router_aux_loss_coef` x the aux loss, and
    reported under `aux["router"]`; the reference's routing costs nothing more. `slots`: the
    sequences per packed row (2 x `preference_pack.max_pairs_for(model.max_segments)`), for
    batches of packed rows (`preference_packed`: the loss is then a `TokenSum` over pairs)."""
    if reference not in REFERENCES:
        raise ValueError(f"reference {reference!r}: one of {', '.join(REFERENCES)}")

    def loss_fn(params, batch, state=None, rng=None, train=True):
        if router is None:
            logits = pair_logits(model, params, batch, rng if train else None)
        else:
            logits, stats = pair_logits(model, params, batch, rng if train else None, router=True)
        ref = None
        if reference == "precomputed":
            ref = batch["ref_logps"].astype(jnp.float32)
        elif reference == "state":  # in the policy's compute dtype, as the step casts the policy
            ref = reference_logps(model, as_compute(state, params), batch, slots)
        elif reference == "adapters_off":
            ref = reference_logps(model, adapters_off(params), batch, slots)
        if is_packed(batch):
            out = packed_terms(spec, logits, batch, slots, ref)
        else:
            out = preference_terms(spec, logits, batch, ref)
        if router is not None:
            terms, router_aux = router(stats)
            loss = out[0]  # packed: a TokenSum over pairs, the terms once per pair's mean
            loss = TokenSum(loss.total + terms * loss.count, loss.count) if is_packed(batch) else loss + terms
            out = (loss, {**out[1], "router": router_aux})
        return (out, state) if reference == "state" else out

    return loss_fn
