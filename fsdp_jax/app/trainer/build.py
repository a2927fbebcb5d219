"""The trainer's model, loss and the one `build(...)` call from a run config.

Every road that needs the trainer's step (the trainer's `setup`, the planner's
`build_step`, the benchmark and verify commands) calls `trainer_model` for the model
and `build_from_config` for plan, abstract state and steps, so the ten config keywords
that reach `fsdp_jax.train.build.build` are written here once.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh

from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import Decoder, cross_entropy
from fsdp_jax.app.models.lora import LoraSpec, adapted, adapter_mask, spec_from_config
from fsdp_jax.app.models.qlora import CONTRACTED
from fsdp_jax.app.objectives.grpo_loss import choose_grpo_reference, make_grpo_loss
from fsdp_jax.app.objectives.grpo_run import grpo_spec, is_grpo
from fsdp_jax.app.objectives.mtp import add_term, with_mtp
from fsdp_jax.app.objectives.preference_pack import max_pairs_for
from fsdp_jax.app.objectives.preference_run import is_preference, preference_spec
from fsdp_jax.app.objectives.reference import choose_reference, make_preference_loss, with_reference
from fsdp_jax.app.trainer.expert_bias import balancing, bias_rule, without_bias_state
from fsdp_jax.app.trainer.router_metrics import router_terms
from fsdp_jax.model.fns import ModelFns, from_nnx
from fsdp_jax.nvme import NVME_OFFLOADS
from fsdp_jax.quant.fp8 import Fp8Recipe
from fsdp_jax.quant.modules import quantize_module
from fsdp_jax.sharding.context import context_size, zigzag
from fsdp_jax.sharding.frozen_rows import frozen_rows
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.train.build import Built, build
from fsdp_jax.train.step_parts import TokenSum

_UNSET: Any = object()


def trainer_model(
    model_cfg: DecoderConfig, remat: str = "none", lora: LoraSpec | None = None, fp8: Fp8Recipe | None = None
) -> ModelFns:
    """The reference decoder as `ModelFns` (`from_nnx`), with `remat` applied per block,
    `lora`'s adapters (`fsdp_jax.app.models.lora`) and `fp8`'s projections (`fp8_recipe`;
    a delayed recipe's amax histories are the model's state)."""
    if lora is None:
        return from_nnx(lambda rngs: Decoder(model_cfg, rngs=rngs, remat=remat, lora=lora, fp8=fp8))
    if lora.base_quant is None:  # the frozen base's w_down / wo gathered along a major dim (`frozen_rows`)
        frozen = adapted(model_cfg, lora)[0]
        return from_nnx(
            lambda rngs: frozen_rows(Decoder(model_cfg, rngs=rngs, remat=remat, lora=lora, fp8=fp8), frozen)
        )
    weights = {w: CONTRACTED[w] for w in adapted(model_cfg, lora)[0]}  # QLoRA: the targets' weights quantised

    def make(rngs):
        return quantize_module(
            Decoder(model_cfg, rngs=rngs, remat=remat, lora=lora), lora.base_quant, weights, lora.quant_dtype
        )

    return from_nnx(make)


def compute_dtype(cfg):
    """The run's compute dtype (`precision`'s compute=): what a frozen reference is stored in."""
    return Policy.parse(cfg.precision).compute_dtype


def lora_spec(cfg) -> LoraSpec | None:
    """The run config's `lora:` section as the decoder's `LoraSpec` (None: rank 0, no LoRA);
    a quantised base dequantises in the precision's compute dtype."""
    spec = spec_from_config(cfg.lora)
    if spec is None or spec.base_quant is None:
        return spec
    return dataclasses.replace(spec, quant_dtype=np.dtype(Policy.parse(cfg.precision).compute_dtype).name)


def fp8_recipe(cfg) -> Fp8Recipe | None:
    """The run's FP8 recipe (`fp8:` section) when its precision says matmul=fp8, else None."""
    if Policy.parse(cfg.precision).matmul != "fp8":
        return None
    return Fp8Recipe(cfg.fp8.recipe, cfg.fp8.amax_history, cfg.fp8.gather is not False)


def lora_dropout(cfg) -> bool:
    """Does the run drop out its adapters' input (a `lora:` section with dropout > 0)?"""
    return bool(cfg.lora.rank and cfg.lora.dropout)


def dropout_key(cfg) -> jax.Array:
    """The run key of the adapters' dropout: the seed's key folded with 1 (its own stream,
    apart from the init's); step s draws from `fold_in(this, s)` (`fsdp_jax.model.variables`)."""
    return jax.random.fold_in(jax.random.key(cfg.train.seed), 1)


def lora_optimizer(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` with state for the adapters only (`optax.masked`: none for the frozen base)."""
    return optax.masked(optimizer, adapter_mask)


def token_loss(logits, targets, weights) -> TokenSum:
    """Cross-entropy summed over the weighted (trained) targets, and their count: the step
    divides by the global batch's count (`fsdp_jax.train.step.TokenSum`)."""
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(np.float32), targets)
    w = weights.astype(np.float32)
    return TokenSum((losses * w).sum(), w.sum())


def make_loss_fn(model: ModelFns, model_cfg: DecoderConfig | None = None, dropout: bool = False) -> Callable:
    """Next-token cross-entropy on int32 tokens (B, S + 1) (the mean), or on a packed /
    document-masked batch dict (`fsdp_jax.app.data.packing.batch_from_rows`): attention and
    positions per segment, the loss over the weighted targets of the global batch.
    A mixture-of-experts `model_cfg`: plus the router terms (`router_metrics`), and the
    loss returns `(loss, router aux)`; with `mtp_depth` > 0 plus the weighted multi-token
    prediction loss, `mtp_loss` in the aux (`objectives.mtp`) (build with `has_aux=True`:
    `has_loss_aux`).
    `dropout` (the adapters', `lora_dropout`): the step's extended call
    `loss_fn(params, batch, state=, rng=, train=)`, the step's key as the decoder's
    `dropout_key` when training (eval: none); build with `rng=dropout_key(cfg)`."""

    def body_for(m: ModelFns) -> Callable:
        return _moe_loss_fn(m, model_cfg) if has_router_aux(model_cfg) else _dense_loss_fn(m, model_cfg)

    body = body_for(model)
    stateful = model.abstract_model_state is not None  # FP8's amax histories (`fp8_recipe`)
    if not dropout and not stateful:
        return lambda params, batch: body(params, batch, None)

    def loss_fn(params, batch, state=None, rng=None, train=True):
        key = rng if train and dropout else None
        if not stateful:
            return body(params, batch, key)
        new = []  # the state the model returns, beside the loss (`fsdp_jax.model.variables`)

        def apply(p, *args, **kw):
            out, s = model.apply(p, *args, state=state, **kw)
            new.append(s)
            return out

        out = body_for(dataclasses.replace(model, apply=apply))(params, batch, key)
        return out, new[0]

    return loss_fn


def model_inputs(batch) -> dict:
    """The decoder's inputs and the loss's targets of a step's batch: int32 tokens (B, S + 1)
    or a packed / document-masked batch dict. With `context_size()` > 1 every (B, S) array is
    in zig-zag order (`fsdp_jax.sharding.context`), with the positions context attention
    needs; at context 1 a token batch keeps positions and segment ids None."""
    n = context_size()
    if isinstance(batch, dict):
        return zigzag({k: batch[k] for k in ("inputs", "segment_ids", "positions", "targets", "weights")}, n)
    b = {"inputs": batch[:, :-1], "targets": batch[:, 1:], "segment_ids": None, "positions": None, "weights": None}
    if n > 1:
        b["positions"] = jnp.broadcast_to(jnp.arange(batch.shape[1] - 1, dtype=jnp.int32), b["targets"].shape)
        b["inputs"], b["targets"], b["positions"] = zigzag((b["inputs"], b["targets"], b["positions"]), n)
    return b


def next_token_loss(logits, b: dict):
    """The next-token loss of `model_inputs`' dict: the mean cross-entropy, or over weighted
    targets (packed or document-masked rows) a `TokenSum`."""
    if b["weights"] is None:
        return cross_entropy(logits, b["targets"])
    return token_loss(logits, b["targets"], b["weights"])


def _dense_loss_fn(model: ModelFns, cfg: DecoderConfig | None = None) -> Callable:
    depth = cfg.mtp_depth if cfg is not None else 0

    def loss_fn(params, batch, key):
        kw = {} if key is None else {"dropout_key": key}
        kw.update({"mtp": True} if depth else {})
        b = model_inputs(batch)
        if b["positions"] is None:
            out = model.apply(params, b["inputs"], **kw)
        else:
            out = model.apply(params, b["inputs"], b["segment_ids"], b["positions"], **kw)
        return with_mtp(cfg, next_token_loss(out[0], b), out[1], b) if depth else next_token_loss(out, b)

    return loss_fn


def has_router_aux(model_cfg: DecoderConfig | None) -> bool:
    return bool(model_cfg is not None and model_cfg.n_experts)


def has_loss_aux(model_cfg: DecoderConfig | None) -> bool:
    """Does the next-token loss of `model_cfg` return (loss, aux): router terms, an MTP loss?"""
    return has_router_aux(model_cfg) or bool(model_cfg is not None and model_cfg.mtp_depth)


def _moe_loss_fn(model: ModelFns, cfg: DecoderConfig) -> Callable:
    def loss_fn(params, batch, key):
        kw = {} if key is None else {"dropout_key": key}
        b = model_inputs(batch)
        if b["segment_ids"] is not None:  # packed rows: the router sees the real tokens only
            kw["token_mask"] = b["segment_ids"] > 0
        kw.update({"mtp": True} if cfg.mtp_depth else {})
        logits, stats = model.apply(params, b["inputs"], b["segment_ids"], b["positions"], router=True, **kw)
        extra, aux = router_terms(cfg, stats)
        if not cfg.mtp_depth:
            return add_term(next_token_loss(logits, b), extra), aux
        loss, more = with_mtp(cfg, next_token_loss(logits[0], b), logits[1], b)
        return add_term(loss, extra), {**aux, **more}

    return loss_fn


def objective_loss(cfg, model: ModelFns, precomputed: bool | None = None) -> tuple[ModelFns, Callable | None]:
    """(model, loss_fn) of a preference or GRPO objective as the trainer runs it: the frozen
    reference in model state (stored in the compute dtype), the LoRA base with adapters off,
    or none; a mixture of experts' router terms on a preference loss. `precomputed`
    (default: the config's `precompute_ref_log_probs`): reference log-probs in the batch.
    `(model, None)` under sft (the caller's next-token loss). Build with `has_aux=True`."""
    lora = lora_spec(cfg) is not None
    if is_preference(cfg):
        spec = preference_spec(cfg)
        pre = cfg.preference.precompute_ref_log_probs if precomputed is None else precomputed
        reference = choose_reference(spec, lora, pre)
        model = with_reference(model, compute_dtype(cfg)) if reference == "state" else model
        router = functools.partial(router_terms, cfg.model) if has_router_aux(cfg.model) else None
        slots = 2 * max_pairs_for(cfg.model.max_segments) if cfg.preference.packing else 0
        return model, make_preference_loss(model, spec, reference, router, slots)
    if is_grpo(cfg):
        spec = grpo_spec(cfg)
        reference = choose_grpo_reference(spec, lora)
        model = with_reference(model, compute_dtype(cfg)) if reference == "state" else model
        return model, make_grpo_loss(model, spec, reference)
    return model, None


def build_from_config(
    cfg,
    model: ModelFns,
    optimizer: optax.GradientTransformation,
    mesh: Mesh,
    strategy: str | None = None,
    *,
    loss_fn: Callable | None = None,
    max_replicated_fraction: float | None = _UNSET,
    **step_options,
) -> Built:
    """`fsdp_jax.train.build.build` with the run config's mesh rules, step and precision
    options. `strategy` defaults to `cfg.mesh.strategy`, `loss_fn` to `make_loss_fn(model)`,
    `max_replicated_fraction` to the config's (None: not enforced, as the planner wants);
    `step_options` go to `make_train_step` on top of the config's. Adapter dropout: the
    step's run key is `dropout_key(cfg)` (a `loss_fn` given must be `make_loss_fn(...,
    dropout=True)`'s)."""
    if lora_spec(cfg) is not None:  # only the adapters train (the optimizer is `lora_optimizer`'s)
        step_options.setdefault("trainable", adapter_mask)
    if lora_dropout(cfg):
        step_options.setdefault("rng", dropout_key(cfg))
    if balancing(cfg.model):  # the score-correction bias moves by the rule, keeps no optimizer state
        optimizer = without_bias_state(optimizer)
        step_options.setdefault("post_update", bias_rule(cfg.model))
    if max_replicated_fraction is _UNSET:
        max_replicated_fraction = cfg.mesh.max_replicated_fraction
    return build(
        model,
        optimizer,
        mesh,
        strategy or cfg.mesh.strategy,
        loss_fn=make_loss_fn(model, cfg.model, lora_dropout(cfg)) if loss_fn is None else loss_fn,
        has_aux=has_loss_aux(cfg.model) or cfg.objective != "sft",  # preference losses: their metrics
        rules=cfg.mesh.rules,
        min_shard_size=cfg.mesh.min_shard_size,
        max_replicated_fraction=max_replicated_fraction,
        min_replicated_bytes=cfg.mesh.min_replicated_bytes,
        microbatches=cfg.train.microbatches,
        clip_norm=cfg.optimizer.clip_norm,
        precision=cfg.precision,
        offload="none" if cfg.offload in NVME_OFFLOADS else cfg.offload,  # nvme: the trainer wraps the step
        **step_options,
    )
