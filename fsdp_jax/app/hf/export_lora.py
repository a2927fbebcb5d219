"""A LoRA run's adapters as a PEFT directory, or merged into its base as a Hugging Face model.

    export_peft("runs/lora", "out/adapter")          # scripts/export.py RUN --peft OUT
    export_merged("runs/lora", "out/merged-hf")      # scripts/export.py RUN --hf OUT (a LoRA run)

A LoRA run's checkpoints hold its adapters only (`fsdp_jax.app.trainer.lora_state`); the
base is the run's `init_from=hf:DIR`, read again tensor by tensor. The merged export writes
W + scale * A B (in f32, cast to W's dtype) for each targeted weight and every other tensor
exactly as the base stores it (bit-identical), in the base's family (`export.write_hf_dir`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fsdp_jax.app.hf import load, moe_layout, peft
from fsdp_jax.app.hf.export import check_out_dir, saved_source, write_hf_dir
from fsdp_jax.app.models import lora
from fsdp_jax.app.models.decoder import Decoder
from fsdp_jax.app.models.qlora import as_trained
from fsdp_jax.checkpoint import CheckpointError, tree_paths
from fsdp_jax.model.fns import from_nnx


def _lora_source(directory, step, flag: str):
    """(checkpointer, step, run config, LoraSpec) of a LoRA run; CheckpointError otherwise."""
    ckpt, s, run_cfg = saved_source(directory, step)
    spec = lora.spec_from_config(run_cfg.lora)
    if spec is None:
        raise CheckpointError(f"{flag}: {directory} is not a LoRA run (its config has lora.rank 0); use --hf or --out")
    return ckpt, s, run_cfg, spec


def read_adapters(ckpt, step: int) -> dict:
    """The saved adapters of `step` as a nested numpy tree (layer keys as ints)."""
    out: dict = {}
    for path in ckpt.saved_metadata(step):
        if not (path.startswith("params/") and lora.is_adapter(path)):
            continue
        keys = [int(k) if k.isdigit() else k for k in path.removeprefix("params/").split("/")]
        node = out
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = np.asarray(ckpt.read_leaf(step, path))
    return out


def export_peft(directory: str | os.PathLike, out: str | os.PathLike, *, step: int | None = None) -> dict:
    """Write the run's adapters (newest usable step, or `step`) as PEFT directory `out`."""
    ckpt, s, run_cfg, spec = _lora_source(directory, step, "--peft")
    base = str(load.hf_dir(run_cfg.init_from)) if load.is_hf(run_cfg.init_from) else None
    info = peft.write_peft(out, read_adapters(ckpt, s), run_cfg.model, spec, base)
    return {"step": s, **info}


def export_merged(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    step: int | None = None,
    max_shard_bytes: int | None = None,
) -> dict:
    """Write the run's base with its adapters merged as a Hugging Face directory `out`."""
    out = Path(out)
    check_out_dir(out, "--hf")
    ckpt, s, run_cfg, spec = _lora_source(directory, step, "--hf")
    if not load.is_hf(run_cfg.init_from):
        raise CheckpointError(
            f"--hf: the LoRA run {directory} has init_from={run_cfg.init_from!r}; a merged export "
            "needs its base as init_from=hf:DIR (export the adapters with --peft)"
        )
    cfg = run_cfg.model
    base = load.open_init(run_cfg.init_from, cfg)
    adapters = read_adapters(ckpt, s)
    sources = load.leaf_sources(cfg)
    shapes = {p: tuple(x.shape) for p, x in tree_paths(_abstract(cfg)).items()}
    first = {p: names[0].format(e=0) for p, (names, _) in sources.items()}  # an expert leaf: expert 0's
    dtypes = {p: base.where[n].dtype(n) for p, n in first.items()}

    def read_leaf(path: str) -> np.ndarray:
        names, kind = sources[path]
        shape = shapes[path]
        stacked = len(names) > 1 or moe_layout.is_stacked(cfg, path)
        leaf = base.read(names, kind, tuple(slice(0, n) for n in shape), shape, dtypes[path], stacked)
        trained = as_trained(path, leaf, cfg, spec)  # QLoRA: the dequantised weight the run trained on
        return peft.merged_leaf(path, trained, adapters, cfg, spec).astype(
            leaf.dtype
        )  # as the base stores it if not adapted

    kw = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    hint = load.read_config_json(load.hf_dir(run_cfg.init_from)).get("model_type")
    info = write_hf_dir(out, run_cfg, hint, dtypes, read_leaf, dtype, **kw)
    return {"step": s, **info, "dequantised": None if spec.base_quant is None else spec.base_quant.label}


def _abstract(cfg):

    return from_nnx(lambda rngs: Decoder(cfg, rngs=rngs)).abstract_params
