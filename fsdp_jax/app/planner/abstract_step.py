"""The trainer's train step for a config, built from abstract inputs: one concept, the
step the planner measures and the benchmarks time.

    b = build_step(cfg, "full_shard", jax.devices()[:8])
    compiled = b.compile()

`build_step` is `fsdp_jax.train.build.build` with the trainer's model, loss, optimizer and
step options (as `fsdp_jax.app.trainer.loop.setup`), from `ShapeDtypeStruct`s carrying
shardings: nothing is allocated. Its batch is the trainer's: int32 tokens (B, S + 1),
or for a packed corpus or data.document_mask the dict of (B, S) arrays with segment
ids, positions and weights (`abstract_batch`). `mesh_shape` resolves the config's mesh exactly as
the trainer does; `target_mesh_sizes` lays hybrid_shard over a multi-host GPU target.
The formulas that estimate its memory are `fsdp_jax.app.planner.memory_model`; compiling and
reporting it for many strategies is `fsdp_jax.app.planner.estimate`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fsdp_jax.app.data.packing import batch_from_rows
from fsdp_jax.app.objectives.grpo_run import grpo_batch, is_grpo
from fsdp_jax.app.objectives.preference_pack import max_pairs_for
from fsdp_jax.app.objectives.preference_run import is_preference
from fsdp_jax.app.planner.grpo_plan import abstract_grpo_batch, row_cfg
from fsdp_jax.app.trainer.build import (
    build_from_config,
    fp8_recipe,
    lora_optimizer,
    lora_spec,
    objective_loss,
    trainer_model,
)
from fsdp_jax.app.trainer.optim import build_optimizer
from fsdp_jax.errors import PlanError, one_line
from fsdp_jax.sharding.mesh import make_mesh, resolve_mesh_shape
from fsdp_jax.sharding.strategy import get_strategy
from fsdp_jax.targets.compile_cache import compile_lowered


def mesh_shape(cfg, strategy: str, n_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) for `strategy` on `n_devices`: the config's mesh, resolved
    exactly as the trainer resolves it (`fsdp_jax.sharding.mesh.make_mesh`), for every
    strategy. The planner builds the trainer's step, never a neighbour of it: with
    data=1, hybrid_shard plans what the trainer would run (the fsdp axis over every
    device, like full_shard); set mesh.data > 1 to plan replicas over data.
    `strategy` is accepted for callers that pick a mesh per strategy."""

    del strategy
    data, fsdp, _, tensor = resolve_mesh_shape(
        (cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.context, cfg.mesh.tensor), n_devices
    )  # the context size is cfg.mesh.context (build_step passes it)
    return data, fsdp, tensor


def target_mesh_sizes(cfg, strategy: str, n_devices: int, hosts: int) -> tuple[int, int, int]:
    """Mesh sizes on a `hosts`-host cluster: `mesh_shape`, except that hybrid_shard on a
    config without its own data axis puts `data` across the hosts and `fsdp` within one
    (HSDP's layout: reduce-scatter over NVLink, a gradient all-reduce across hosts)."""
    data, fsdp, tensor = mesh_shape(cfg, strategy, n_devices)
    if (
        strategy == "hybrid_shard"
        and hosts > 1
        and cfg.mesh.data in (1, -1)
        and (data * fsdp) % hosts == 0
        and data * fsdp // hosts > 1
    ):
        data, fsdp = hosts, data * fsdp // hosts
    return data, fsdp, tensor


# The packed batch (`fsdp_jax.app.data.packing.batch_from_rows` / `batch_from_windows`): (B, S) each.
PACKED_BATCH = {
    "inputs": np.int32,
    "targets": np.int32,
    "weights": np.float32,
    "segment_ids": np.int32,
    "positions": np.int32,
}


def packed_batch(cfg) -> bool:
    """Whether the trainer feeds this config packed batch dicts (segment ids, positions,
    weights), as `fsdp_jax.app.trainer.loop.make_batches` decides: data.document_mask, or a
    packed fine-tuning corpus (meta.json "format": "packed") at data.path."""
    if cfg.data.document_mask:
        return True
    try:
        return json.loads((Path(cfg.data.path) / "meta.json").read_text()).get("format") == "packed"
    except (OSError, ValueError, AttributeError):
        return False


# A preference batch (`fsdp_jax.app.objectives.preference_data.collate`): (B, 2, S + 1) each.
PAIR_BATCH = {"tokens": np.int32, "completion": np.uint8, "attention": np.uint8}
# Packed preference rows (`fsdp_jax.app.objectives.preference_pack`): (B, S + 1) each.
PACKED_PAIR_BATCH = {"tokens": np.int32, "completion": np.uint8, "segment_ids": np.int32}


def abstract_batch(cfg, sharding):
    """The global batch the trainer's step takes, as ShapeDtypeStructs with `sharding`:
    int32 (B, S + 1) tokens, or the packed dict of (B, S) arrays (`packed_batch`), or a
    preference batch of pairs, or a GRPO batch (`grpo_plan.abstract_grpo_batch`)."""
    b, s = cfg.train.global_batch, cfg.data.seq_len
    if is_grpo(cfg):  # prompt + completion rows and their masks (objectives.grpo_loss)
        return abstract_grpo_batch(cfg, sharding)
    if is_preference(cfg) and cfg.preference.packing:  # rows (B, S + 1) of several pairs each
        out = {k: jax.ShapeDtypeStruct((b, s + 1), dt, sharding=sharding) for k, dt in PACKED_PAIR_BATCH.items()}
        if cfg.preference.precompute_ref_log_probs:  # per sequence slot of a row
            slots = 2 * max_pairs_for(cfg.model.max_segments)
            out["ref_logps"] = jax.ShapeDtypeStruct((b, slots), np.float32, sharding=sharding)
        return out
    if is_preference(cfg):  # pairs (B, 2, S + 1): chosen and rejected rows of one prompt together
        out = {k: jax.ShapeDtypeStruct((b, 2, s + 1), dt, sharding=sharding) for k, dt in PAIR_BATCH.items()}
        if cfg.preference.precompute_ref_log_probs:
            out["ref_logps"] = jax.ShapeDtypeStruct((b, 2), np.float32, sharding=sharding)
        return out
    if packed_batch(cfg):
        return {k: jax.ShapeDtypeStruct((b, s), dt, sharding=sharding) for k, dt in PACKED_BATCH.items()}
    return jax.ShapeDtypeStruct((b, s + 1), np.int32, sharding=sharding)


def sample_batch(cfg, batch, rng: np.random.Generator):
    """A concrete host batch shaped like `batch` (`abstract_batch`) for timing the step:
    random tokens; a packed batch holds two examples per row, every target trained; a
    preference pair's first half is its prompt, the rest its completion; a GRPO batch is
    `grpo_run.grpo_batch`'s; a packed preference row holds two pairs (four equal segments)."""
    if is_grpo(cfg):
        return grpo_batch(row_cfg(cfg), rng)
    if isinstance(batch, dict) and "segment_ids" in batch and "completion" in batch:
        shape = batch["tokens"].shape
        quarter = np.arange(shape[-1]) * 4 // shape[-1]  # 0..3: pair 1 chosen, rejected, pair 2 ...
        within = np.arange(shape[-1]) - quarter * shape[-1] / 4
        out = {
            "tokens": rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32),
            "completion": np.broadcast_to(within >= shape[-1] / 8, shape).astype(np.uint8),
            "segment_ids": np.broadcast_to(quarter + 1, shape).astype(np.int32),
        }
        if "ref_logps" in batch:
            ref = np.zeros(batch["ref_logps"].shape, np.float32)
            ref[:, :4] = -rng.random((shape[0], 4), dtype=np.float32) * shape[-1] / 4
            out["ref_logps"] = ref
        return out
    if isinstance(batch, dict) and "completion" in batch:
        shape = batch["tokens"].shape
        out = {
            "tokens": rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32),
            "completion": (np.arange(shape[-1]) >= shape[-1] // 2).astype(np.uint8) * np.ones(shape, np.uint8),
            "attention": np.ones(shape, np.uint8),
        }
        if "ref_logps" in batch:
            out["ref_logps"] = -rng.random(batch["ref_logps"].shape, dtype=np.float32) * shape[-1]
        return out
    if not isinstance(batch, dict):
        return rng.integers(0, cfg.model.vocab_size, batch.shape, dtype=np.int32)

    shape = batch["inputs"].shape
    tokens = rng.integers(0, cfg.model.vocab_size, shape, dtype=np.int32)
    seg = np.where(np.arange(shape[1]) < shape[1] // 2, 1, 2) * np.ones(shape, np.int32)
    return batch_from_rows(tokens, np.ones(shape, np.uint8), seg)


@dataclasses.dataclass
class StepBuild:
    """One strategy's train step built abstractly, as the trainer would build it."""

    cfg: Any
    strategy: str
    mesh: jax.sharding.Mesh
    model: Any  # fsdp_jax.train.shard_model.ModelFns
    optimizer: Any
    plan: Any  # ShardingPlan
    state: Any  # TrainState of sharded ShapeDtypeStructs
    batch: Any  # the trainer's batch: int32 (B, S + 1) tokens, or `packed_batch`'s dict
    step: Any  # CompiledStep
    built: Any  # fsdp_jax.train.build.Built

    def compile(self, compiler_options: dict[str, Any] | None = None):
        """AOT-compile the step; `compiler_options`: XLA debug options for this compile
        only (e.g. {"xla_gpu_enable_while_loop_double_buffering": "true"}). A deviceless
        target's compile is kept by its program (`fsdp_jax.targets.compile_cache`). Lowered with the
        mesh's first device as the default device, so code that asks what it runs on (the MoE
        layer's `grouped_matmul: auto`, tokamax's kernels) sees the target, not this host's CPU."""
        with jax.default_device(self.mesh.devices.flat[0]):
            lowered = self.step.lower(self.state, self.batch)
        try:
            return compile_lowered(lowered, self.mesh.devices.flat, compiler_options)
        except Exception as e:  # XLA rejects unknown options / values with a generic error type
            if compiler_options and ("option" in str(e).lower() or "flag" in str(e).lower()):
                raise PlanError(f"--xla-flags: {one_line(e, 300)}") from None
            raise

    def init_state(self, rng: jax.Array):
        """A concrete TrainState in the plan's layout (sharded init: params are created
        shard by shard, never whole on one device), for running the step."""
        return self.built.init_state(rng)


def build_step(
    cfg,
    strategy: str | None = None,
    devices: Sequence[jax.Device] | None = None,
    mesh_sizes: tuple[int, int, int] | None = None,
    **step_options,
) -> StepBuild:
    """The trainer's train step for `cfg` under `strategy` on `devices`, from abstract
    inputs: `fsdp_jax.train.build.build` with the trainer's model, loss, optimizer and step
    options (as `fsdp_jax.app.trainer.loop.setup`), minus the state. The replicated-fraction
    check is not enforced here (the planner reports it instead). `step_options` go to
    `make_train_step` on top of the trainer's (e.g. skip_nonfinite=False, to measure
    what the guard costs)."""

    cfg = row_cfg(cfg)  # a GRPO row: prompt + completion tokens
    strategy = get_strategy(strategy or cfg.mesh.strategy).name
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes or mesh_shape(cfg, strategy, len(devices))
    mesh = make_mesh(*sizes, devices=devices, context=cfg.mesh.context)
    model = trainer_model(cfg.model, cfg.remat, lora_spec(cfg), fp8_recipe(cfg))
    optimizer, _ = build_optimizer(cfg.optimizer, cfg.train.steps)
    if lora_spec(cfg) is not None:  # as the trainer: optimizer state for the adapters only
        optimizer = lora_optimizer(optimizer)
    model, loss_fn = objective_loss(cfg, model)  # as the trainer: preference / GRPO (None: sft)
    built = build_from_config(
        cfg, model, optimizer, mesh, strategy, loss_fn=loss_fn, max_replicated_fraction=None, **step_options
    )
    batch = abstract_batch(cfg, built.plan.batch)
    return StepBuild(
        cfg, strategy, mesh, model, optimizer, built.plan, built.abstract_state, batch, built.train_step, built
    )
