"""The trainer's side of `offload: optimizer:nvme` (`fsdp_jax.nvme`).

The state a run starts from (a fresh init, `init_from`, or the checkpoint it resumes) is
written into the layer files under `offload_dirs` (all of them rewritten: the files are a
working copy, so after a crash or kill the run resumes from its last checkpoint and the
files are rebuilt from it); the step is the `NvmeStep`; a checkpoint is written from
`NvmeStep.gather` of the live state, as from a run without offload, and restores into
any offload setting.
"""

from __future__ import annotations

from pathlib import Path

from fsdp_jax.app.models.lora import adapter_mask
from fsdp_jax.app.trainer.build import dropout_key, has_loss_aux, lora_dropout, lora_spec
from fsdp_jax.errors import ConfigError, OffloadError
from fsdp_jax.nvme import NVME_OFFLOADS, NvmeStep
from fsdp_jax.train.build import Built
from fsdp_jax.train.state import TrainState


def uses_nvme(cfg) -> bool:
    return cfg.offload in NVME_OFFLOADS


def dirs_of(cfg) -> list[str]:
    return [d.strip() for d in cfg.offload_dirs.split(",") if d.strip()]


def start(cfg, built: Built, loss_fn, state: TrainState, run_dir: Path) -> tuple[TrainState, NvmeStep]:
    """(the live state, the step) for `state`; the dirs are checked and claimed for this run
    (its resolved run dir names it) before anything is written (OffloadError, one line)."""
    try:
        nv = NvmeStep(
            built,
            loss_fn,
            dirs_of(cfg),
            owner=str(Path(run_dir).resolve()),
            microbatches=cfg.train.microbatches,
            clip_norm=cfg.optimizer.clip_norm,
            precision=cfg.precision,
            # what the nvme step cannot run yet, for its one-line refusal (`check_streamable`)
            trainable=adapter_mask if lora_spec(cfg) is not None else None,
            rng=dropout_key(cfg) if lora_dropout(cfg) else None,
            has_aux=has_loss_aux(cfg.model) or cfg.objective != "sft",
        )
    except OffloadError as e:  # bad input: exit 2, the key named, nothing written
        key, _, msg = str(e).partition(": ")
        raise ConfigError(key, msg) from None
    return nv.put(state), nv


def saved(run, state: TrainState) -> TrainState:
    """What a checkpoint of `state` holds: the whole state under nvme, else `state`."""
    nv = getattr(run, "nvme", None)
    return nv.gather(state) if nv is not None else state
