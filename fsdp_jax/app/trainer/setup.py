"""The trainer's setup: a run config -> a `Run`, as a list of named stages.

    validate -> data -> model -> mesh -> build -> state

Each stage is entered once, in this order, and reads only what the stages before it
produced (`SETUP_STAGES`; `setup(..., on_stage=print)` shows them). `preflight` is
every check of the inputs that writes nothing; `train` runs it before taking the run
directory's lock, and `setup` then skips the validation it already made.

The state comes from, in order: the newest checkpoint in `<run_dir>/checkpoints`
that restores (when `resume`; laid out for this mesh and strategy, whatever wrote
it), else `cfg.init_from` (params from a safetensors file, another run or, as
`hf:DIR`, a Hugging Face checkpoint read shard by shard; fresh optimizer state), else
`init_params(rng) -> params` (default: the model's init).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import re
import sys
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np
from jax.experimental import multihost_utils

from fsdp_jax.app.config.checks import check_backend, check_data, validate
from fsdp_jax.app.config.fp8_checks import check_fp8_device, unscaled_experts, unscaled_experts_line, unscaled_kernels
from fsdp_jax.app.config.parse import config_to_dict, load_config
from fsdp_jax.app.config.schema import Config
from fsdp_jax.app.data.corpus import ensure_stdlib
from fsdp_jax.app.data.token_check import check_corpus_vocab
from fsdp_jax.app.data.windows import load_meta
from fsdp_jax.app.hf.load import is_hf, model_section_from_hf
from fsdp_jax.app.host_memory import check_host_memory, stated_host_memory
from fsdp_jax.app.objectives.grpo_run import check_grpo, is_grpo
from fsdp_jax.app.objectives.preference_run import (
    is_preference,
    load_pairs,
    packing_line,
    precompute_ref_logps,
    preference_spec,
)
from fsdp_jax.app.objectives.reference import reference_copy
from fsdp_jax.app.trainer import lora_state, nvme_run
from fsdp_jax.app.trainer.build import (
    build_from_config,
    compute_dtype,
    fp8_recipe,
    lora_dropout,
    lora_optimizer,
    lora_spec,
    make_loss_fn,
    objective_loss,
    trainer_model,
)
from fsdp_jax.app.trainer.init_from import base_loader, open_hf_init
from fsdp_jax.app.trainer.optim import build_optimizer
from fsdp_jax.app.trainer.run_dir import check_dir_path
from fsdp_jax.checkpoint import Checkpointer, Restored, filled_note, latest_step, open_safetensors
from fsdp_jax.errors import CheckpointError, ConfigError, one_line
from fsdp_jax.model.fns import ModelFns
from fsdp_jax.quant import fp8_modules
from fsdp_jax.sharding import offload, remat
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.strategy import ShardingPlan
from fsdp_jax.train.state import TrainState


def load_run_config(path, overrides=()):
    """`load_config` with the trainer's fill: `init_from=hf:PATH` fills the model section from
    that checkpoint's config.json (keys the user set win). Every command reads its config here."""

    return load_config(path, overrides, fill=model_section_from_hf)


@dataclasses.dataclass
class Run:
    """Everything one training run holds."""

    cfg: Config
    mesh: jax.sharding.Mesh
    model: ModelFns
    optimizer: Any
    schedule: Callable[[int], Any]
    plan: ShardingPlan
    state: TrainState
    train_step: Any  # CompiledStep
    eval_step: Any
    loss_fn: Callable
    run_dir: Path
    is_main: bool
    checkpointer: Checkpointer | None = None
    rng: jax.Array | None = None  # the run's seed-derived key (saved in checkpoints)
    restored: Restored | None = None  # the checkpoint this run resumed from
    start_step: int = 0  # steps (batches) done before this run started
    setup_s: float = 0.0  # wall seconds train() spent in setup (for goodput)
    lora_base: dict | None = None  # a LoRA run's base fingerprint (`lora_state`), saved with each checkpoint
    nvme: Any = None  # nvme offload: the NvmeStep / ParamsNvmeStep (also `train_step`); `state` is its live state


# ------------------------------------------------------------------------------- checks


def check_offload(cfg: Config) -> None:
    """ConfigError naming `offload` / `remat` when they move state or activations to host
    memory and this backend has none; naming FSDP_JAX_HOST_MEMORY when it is not a size."""
    try:
        offload.check_supported("none" if nvme_run.uses_nvme(cfg) else cfg.offload, jax.devices())
    except offload.OffloadError as e:
        raise ConfigError("offload", str(e).removeprefix("offload: ")) from None
    nvme_run.check_layerwise(cfg)  # optimizer+params:nvme: what its layer-wise step does not run yet
    if nvme_run.uses_nvme(cfg) and not nvme_run.dirs_of(cfg):  # a plan of it needs none: checked here
        raise ConfigError(
            "offload_dirs",
            f"'' is invalid; offload: {cfg.offload} keeps the state in files: name their dirs "
            "(offload_dirs=/nvme0,/nvme1)",
        )
    stated_host_memory()  # a bad FSDP_JAX_HOST_MEMORY fails here, offload or not, before anything is written
    if remat.remat_policy(cfg.remat).offloads and not offload.host_memory_available(jax.devices()):
        raise ConfigError(
            "remat",
            f"{cfg.remat!r} offloads activations to host memory "
            f"({offload.HOST}), which this backend "
            f"({jax.devices()[0].platform}) does not offer; use a policy without "
            "offload_ (e.g. dots)",
        )


def preflight(cfg: Config, progress: bool = False) -> None:
    """Every check of the run's inputs that needs no writing: the config against the
    devices and backend, and the places the run will write (run_dir; data.path when the
    corpus is to be prepared), init_from's header, the corpus's token ids against
    model.vocab_size (`token_check`; a prepared corpus only: the stdlib one is bytes).
    Raises ConfigError, DataError or CheckpointError (bad input)."""
    validate(cfg, n_devices=jax.device_count())
    check_backend(cfg, jax.default_backend())
    dev = jax.devices()[0]
    check_fp8_device(cfg, dev.platform, dev.device_kind, getattr(dev, "compute_capability", None))
    check_offload(cfg)
    if cfg.train.tensorboard and importlib.util.find_spec("tensorboardX") is None:
        raise ConfigError(
            "train.tensorboard", "true needs the tensorboardX package (pip install tensorboardX), or set it to false"
        )
    check_dir_path(cfg.run_dir, "run_dir")
    if is_preference(cfg):  # every row read and tokenized now: a bad one fails before anything is written
        preference_spec(cfg)
        load_pairs(cfg)
    elif is_grpo(cfg):  # the section, the prompts and every reward loaded once: before anything is written
        check_grpo(cfg, jax.process_count())
    elif cfg.data.source == "stdlib" and not (Path(cfg.data.path) / "meta.json").exists():
        check_dir_path(cfg.data.path, "data.path")
    else:
        check_data(cfg)
        check_corpus_vocab(cfg.data.path, cfg.model.vocab_size, progress)
    if cfg.init_from and not re.match(r"[A-Za-z][\w+.-]*:", cfg.init_from):  # scheme:... is not a path
        init = Path(cfg.init_from)
        if not init.exists():
            raise ConfigError("init_from", f"{cfg.init_from!r}: no such file or directory")
        if init.is_file():
            try:
                open_safetensors(init)  # the header only
            except CheckpointError as e:
                raise CheckpointError(f"init_from: {e}") from None


def prepare_data(cfg: Config) -> None:
    """Prepare the default stdlib corpus on first use (process 0), then check the data."""
    if cfg.data.source == "stdlib" and not (Path(cfg.data.path) / "meta.json").exists():
        if jax.process_index() == 0:
            try:
                ensure_stdlib(cfg.data.path)
            except OSError as e:
                raise ConfigError(
                    "data.path", f"{cfg.data.path!r}: cannot prepare the stdlib corpus there ({e.strerror or e})"
                ) from None
        if jax.process_count() > 1:
            multihost_utils.sync_global_devices("fsdp_jax:prepare_data")
    check_data(cfg)
    load_meta(cfg.data.path)  # meta.json's dtype and the bins' sizes, before any write


# ------------------------------------------------------------------------------- stages


@dataclasses.dataclass
class _Draft:
    """What the stages produce, filled in stage by stage."""

    cfg: Config
    init_params: Callable | None
    resume: bool
    validated: bool
    hf_ckpt: Any = None
    model: ModelFns | None = None
    optimizer: Any = None
    schedule: Any = None
    loss_fn: Callable | None = None
    rng: jax.Array | None = None
    mesh: jax.sharding.Mesh | None = None
    built: Any = None
    run: Run | None = None


def _validate(p: _Draft) -> None:
    """The config against the devices; a Hugging Face init_from is opened here, once,
    so a bad one fails before anything is written."""
    if not p.validated:
        validate(p.cfg, n_devices=jax.device_count())
        check_offload(p.cfg)
    resuming = p.resume and latest_step(Path(p.cfg.run_dir) / "checkpoints") is not None
    if is_hf(p.cfg.init_from) and (not resuming or lora_spec(p.cfg) is not None):  # LoRA: the base again
        p.hf_ckpt = open_hf_init(p.cfg)


def _data(p: _Draft) -> None:
    if is_preference(p.cfg):
        load_pairs(p.cfg)
        if p.cfg.preference.packing and jax.process_index() == 0:
            print(packing_line(p.cfg), flush=True)
        if p.cfg.preference.eval_path:  # the held-out pairs: bad ones refused before anything is written
            load_pairs(p.cfg, "preference.eval_path")
    elif not is_grpo(p.cfg):
        prepare_data(p.cfg)


def _model(p: _Draft) -> None:
    cfg = p.cfg
    p.rng = jax.random.key(cfg.train.seed)
    p.model = trainer_model(cfg.model, cfg.remat, lora_spec(cfg), fp8_recipe(cfg))
    if (dtype := unscaled_experts(cfg)) is not None and jax.process_index() == 0:  # FP8 asked, experts not
        print(f"note: {unscaled_experts_line(cfg, dtype, unscaled_kernels(dtype))}", flush=True)
    if p.init_params is not None:
        p.model = dataclasses.replace(p.model, init=p.init_params, abstract_params=jax.eval_shape(p.init_params, p.rng))
    p.optimizer, p.schedule = build_optimizer(cfg.optimizer, cfg.train.steps)
    if lora_spec(cfg) is not None:
        p.optimizer = lora_optimizer(p.optimizer)
    p.loss_fn = make_loss_fn(p.model, cfg.model, lora_dropout(cfg))
    if cfg.objective != "sft":  # preference / GRPO: its loss and reference (`build.objective_loss`)
        p.model, p.loss_fn = objective_loss(cfg, p.model)


def _mesh(p: _Draft) -> None:
    p.mesh = make_mesh(p.cfg.mesh.data, p.cfg.mesh.fsdp, p.cfg.mesh.tensor, context=p.cfg.mesh.context)


def _build(p: _Draft) -> None:
    """The plan, abstract state and steps; then the offloaded state against this node's
    host memory (`fsdp_jax.app.host_memory`), before any state exists or a file is written."""
    p.built = build_from_config(p.cfg, p.model, p.optimizer, p.mesh, loss_fn=p.loss_fn)
    if not nvme_run.uses_nvme(p.cfg) and offload.get_offload(p.cfg.offload).any:
        check_host_memory(offload.host_bytes_per_process(p.built.abstract_state), p.cfg.offload)


def _state(p: _Draft) -> None:
    """Checkpoint restore, else init_from, else a fresh init; the Run."""
    cfg, built, rng = p.cfg, p.built, p.rng
    run_dir, is_main = Path(cfg.run_dir), jax.process_index() == 0
    ckpt = Checkpointer(run_dir / "checkpoints", keep=cfg.train.keep_checkpoints)
    if is_main:
        for d in ckpt.partial:
            print(f"warning: ignoring partial checkpoint {d} (its save was interrupted); removed", flush=True)
    restored, start, lora = None, 0, lora_spec(cfg) is not None
    nvme = nvme_run.open_step(cfg, built, p.loss_fn, run_dir, p.model)  # nvme: dirs claimed; stacked leaves streamed
    if p.resume and ckpt.steps():
        target = lora_state.saved_abstract(built.abstract_state) if lora else built.abstract_state
        target, then = nvme_run.restore_target(nvme, target), nvme_run.after_restore(nvme)
        restored = ckpt.restore(target, set_aside_damaged=True, then=then, fill_missing=fp8_modules.fills_with_zeros)
        try:  # extras are JSON anyone can edit: a bad value names the checkpoint, not a traceback
            state, start = restored.state, int(restored.extras.get("step", restored.step))
            rng = _rng_from(restored.extras.get("rng"), rng)
        except (ValueError, TypeError, KeyError) as e:
            raise CheckpointError(
                f"checkpoint {ckpt.step_dir(restored.step)}: invalid extras (step / rng: {one_line(e, 160)})"
            ) from None
        if lora:  # adapters and their optimizer state only: the base is loaded again and checked
            begun = lora_state.start(
                cfg, built, p.rng, base_loader(p.cfg, p.hf_ckpt, p.model.init, p.rng), adapters=state.params
            )
            lora_state.check_fingerprint(
                restored.extras.get("lora_base"), begun.base, f"checkpoint {ckpt.step_dir(restored.step)}"
            )
            state, lora_base = state.replace(params=begun.params), begun.base
        if is_main:
            for w in restored.warnings + _config_changes(restored.extras.get("config"), cfg):
                print(f"warning: {w}", flush=True)
            if restored.filled:  # an older delayed-FP8 checkpoint: its newer histories start empty
                print(f"warning: {filled_note(ckpt.step_dir(restored.step), restored.filled)}", file=sys.stderr)
            print(f"resuming from checkpoint step {restored.step} ({ckpt.step_dir(restored.step)})", flush=True)
    elif lora:  # the frozen base (init_from or a fresh init) and the adapters (PEFT's or peft:DIR)
        begun = lora_state.start(cfg, built, rng, base_loader(p.cfg, p.hf_ckpt, p.model.init, p.rng))
        state, lora_base = built.state_from_params(begun.params), begun.base
        if is_main and (cfg.init_from or cfg.lora.init_from):
            print(
                f"initialised params from {cfg.init_from or 'a fresh init'} + {cfg.lora.init_from or 'new adapters'}",
                flush=True,
            )
    elif cfg.init_from:  # a Hugging Face checkpoint (read shard by shard), a file or a run
        params = base_loader(p.cfg, p.hf_ckpt, p.model.init, p.rng)(built.abstract_state.params)
        # a reference kept in model state starts as these weights too (in the compute dtype: `with_reference`)
        ref = reference_copy(params, compute_dtype(cfg)) if built.plan.model_state is not None else None
        state = built.state_from_params(params) if ref is None else built.place(params, ref)
        if is_main:
            print(f"initialised params from {cfg.init_from}", flush=True)
    else:
        state = built.init_state(rng)
    if is_preference(cfg) and cfg.preference.precompute_ref_log_probs and preference_spec(cfg).needs_reference:
        precompute_ref_logps(cfg, p.model, built.plan, state.params, resumed=restored is not None)
    state = nvme_run.live(nvme, state, restored is not None)  # nvme: the layer files written
    train_step = built.train_step if nvme is None else nvme
    p.run = Run(
        cfg,
        p.mesh,
        p.model,
        p.optimizer,
        p.schedule,
        built.plan,
        state,
        train_step,
        built.eval_step,
        p.loss_fn,
        run_dir,
        is_main,
        ckpt,
        rng,
        restored,
        start,
        lora_base=lora_base if lora else None,
        nvme=nvme,
    )


SETUP_STAGES: tuple[tuple[str, Callable[[_Draft], None]], ...] = (
    ("validate", _validate),
    ("data", _data),
    ("model", _model),
    ("mesh", _mesh),
    ("build", _build),
    ("state", _state),
)


def setup(
    cfg: Config,
    init_params: Callable | None = None,
    *,
    resume: bool = True,
    validated: bool = False,
    on_stage: Callable[[str], None] | None = None,
) -> Run:
    """Run `SETUP_STAGES` in order and return the `Run` (see the module docstring).
    `validated`: `preflight` already checked `cfg` against the devices. `on_stage(name)`
    is called as each stage is entered. Raises CheckpointError when checkpoints exist
    but none restores or fits."""
    parts = _Draft(cfg, init_params, resume, validated)
    for name, stage in SETUP_STAGES:
        if on_stage is not None:
            on_stage(name)
        stage(parts)
    return parts.run


# ------------------------------------------------------------------------- resume extras


def _rng_from(saved: dict | None, default: jax.Array) -> jax.Array:
    if not saved:
        return default
    return jax.random.wrap_key_data(np.asarray(saved["data"], np.uint32), impl=saved["impl"])


def rng_to_json(key: jax.Array) -> dict:
    return {"impl": str(jax.random.key_impl(key)), "data": np.asarray(jax.random.key_data(key)).tolist()}


def _config_changes(saved: dict | None, cfg: Config) -> list[str]:
    """One line naming the config keys that differ from the checkpoint's, if any. A key the
    checkpoint's config lacks (it was written by an older release) counts only when this run
    sets it away from its default, which is what the older release did."""
    if not saved:
        return []

    def flat(d: dict) -> dict:
        return {
            f"{k}.{j}" if isinstance(v, dict) else k: w
            for k, v in d.items()
            for j, w in (v.items() if isinstance(v, dict) else [(k, v)])
        }

    a, b, default = flat(saved), flat(config_to_dict(cfg)), flat(config_to_dict(Config()))
    a.update({k: default[k] for k in b.keys() - a.keys() if k in default})
    diff = [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(a.keys() | b.keys()) if a.get(k) != b.get(k)]
    return [f"resuming with a config that differs from the checkpoint's: {', '.join(diff)}"] if diff else []
