"""The trainer's side of `offload: optimizer:nvme` (`fsdp_jax.nvme`), and the door to
`optimizer+params:nvme`'s (`params_nvme.ParamsNvmeStep`, which answers the same calls).

The state a run starts from (a fresh init, `init_from`, or the checkpoint it resumes) is
written into the layer files under `offload_dirs` (all of them rewritten: the files are a
working copy, so after a crash or kill the run resumes from its last checkpoint and the
files are rebuilt from it, a layer at a time: `NvmeStep.restore_target` / `put_restored`);
the step is the `NvmeStep`; a checkpoint is written from `NvmeStep.to_save` of the live
state (its stacked leaves streamed layer by layer out of the layer files into the
checkpoint's shard files), in the format of a run without offload, and restores into any
offload setting.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from fsdp_jax.app.models.lora import adapter_mask
from fsdp_jax.app.trainer import params_nvme
from fsdp_jax.app.trainer.build import dropout_key, has_loss_aux, lora_dropout, lora_spec
from fsdp_jax.errors import ConfigError, OffloadError
from fsdp_jax.nvme import NVME_OFFLOADS, PARAMS_NVME, NvmeStep
from fsdp_jax.train.build import Built
from fsdp_jax.train.state import TrainState


def uses_nvme(cfg) -> bool:
    return cfg.offload in NVME_OFFLOADS


def dirs_of(cfg) -> list[str]:
    return [d.strip() for d in cfg.offload_dirs.split(",") if d.strip()]


def check_layerwise(cfg) -> None:
    """ConfigError (one line) when `optimizer+params:nvme` is asked with what its layer-wise step
    does not run yet (`params_nvme.REFUSALS`); checked before anything is written."""
    if cfg.offload == PARAMS_NVME and (why := params_nvme.refusal(cfg)) is not None:
        raise ConfigError(*why)


def open_step(cfg, built: Built, loss_fn, run_dir: Path, model=None):
    """The step (None without nvme): an `NvmeStep`, or under `optimizer+params:nvme` a
    `params_nvme.ParamsNvmeStep` of `model` (the run's ModelFns); the dirs are checked and
    claimed for this run (its resolved run dir names it) before anything is written (bad input:
    ConfigError, one line)."""
    if not uses_nvme(cfg):
        return None
    owner = str(Path(run_dir).resolve())
    try:
        if cfg.offload == PARAMS_NVME:
            return params_nvme.ParamsNvmeStep(cfg, built, model, dirs_of(cfg), owner)
        nv = NvmeStep(
            built,
            loss_fn,
            dirs_of(cfg),
            owner=owner,
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
    return nv


def restore_target(nv: NvmeStep | None, target: TrainState) -> TrainState:
    """What a resume restores: under nvme, all but the stacked leaves (read by `live`)."""
    return target if nv is None else nv.restore_target(target)


def after_restore(nv: NvmeStep | None):
    """`Checkpointer.restore`'s `then`: under nvme, the layer files rebuilt from the restored
    step a layer at a time (`put_restored`; a damaged file there falls back to an older step)."""
    return None if nv is None else nv.put_restored


def live(nv: NvmeStep | None, state: TrainState, restored: bool) -> TrainState:
    """The state the step takes: under nvme and not `restored` (a fresh init, `init_from`),
    the layer files written from `state`."""
    return state if nv is None or restored else nv.put(state)


def whole_params(run, state: TrainState):
    """The params of `state` whole (eval, the sample): under `optimizer+params:nvme` the layers
    read out of the layer files (`ParamsNvmeStep.whole_params`), else `state.params`."""
    nv = getattr(run, "nvme", None)
    return nv.whole_params(state) if hasattr(nv, "whole_params") else state.params


@contextlib.contextmanager
def saved(run, state: TrainState):
    """What a checkpoint of `state` holds, while it is handed to the checkpointer: under nvme,
    the whole state with its stacked leaves streamed out of the layer files
    (`NvmeStep.to_save`), else `state`. A save that raises here writes nothing: the step
    stops waiting for it (`NvmeStep.drop_save`)."""
    nv = getattr(run, "nvme", None)
    if nv is None:
        yield state
        return
    try:
        yield nv.to_save(state, run.checkpointer.check)
    except BaseException:
        nv.drop_save()
        raise
