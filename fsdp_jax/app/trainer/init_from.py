"""The params a run starts from when `init_from` names them: a Hugging Face checkpoint (read
shard by shard, MTP depths it lacks initialised fresh: `hf.mtp_fresh`), a safetensors file or a
run's checkpoint. Setup (`trainer.setup`) opens a Hugging Face one once, before anything is
written, and loads through `base_loader` (LoRA's frozen base too)."""

from __future__ import annotations

from collections.abc import Callable

import jax

from fsdp_jax.app.hf import mtp_fresh
from fsdp_jax.app.hf.load import HFCheckpoint, is_hf, load_params, open_init
from fsdp_jax.app.trainer.build import lora_spec
from fsdp_jax.checkpoint import load_init_params
from fsdp_jax.errors import ConfigError


def open_hf_init(cfg) -> HFCheckpoint:
    """The checked checkpoint of `init_from: hf:PATH`; ConfigError naming model.mtp_depth when a
    LoRA run would need a fresh MTP depth (a frozen random block: nothing would train it)."""
    ckpt = open_init(cfg.init_from, cfg.model)
    if cfg.model.mtp_depth > ckpt.mtp_held and lora_spec(cfg) is not None:
        raise ConfigError(
            "model.mtp_depth",
            f"{cfg.model.mtp_depth}, but {cfg.init_from} holds {ckpt.mtp_held} MTP layers: with LoRA a fresh "
            "depth would stay a frozen random block (train it without LoRA first)",
        )
    return ckpt


def base_loader(cfg, ckpt: HFCheckpoint | None, init: Callable, key: jax.Array) -> Callable | None:
    """`load(abstract params) -> params` from `init_from` (None without one); `ckpt`: the opened
    Hugging Face checkpoint (None: opened here); `init`, `key`: the model's init and the run's
    seed, for the MTP depths a Hugging Face checkpoint lacks (said in one line)."""
    if not cfg.init_from:
        return None
    if not is_hf(cfg.init_from):
        return lambda abstract: load_init_params(cfg.init_from, abstract)

    def load(abstract):
        hf = ckpt or open_init(cfg.init_from, cfg.model)
        if cfg.model.mtp_depth > hf.mtp_held and jax.process_index() == 0:
            print(mtp_fresh.line(hf.path, cfg.model.mtp_depth, hf.mtp_held), flush=True)
        return load_params(hf, abstract, fresh=mtp_fresh.initialiser(init, key, abstract))

    return load
