"""A LoRA run's state: the frozen base from `init_from` (or a fresh init), adapters from
`lora.init_from=peft:DIR` (or PEFT's init), checkpoints of the adapters and their optimizer
state only, and the base's fingerprint that a resume checks.

A checkpoint of a LoRA run is the TrainState with `params` restricted to the adapters (the
optimizer state already is: `optax.masked` keeps none for the base) and, in its extras,
`lora_base`: the base's path, model config and a checksum of its tensors. Resuming loads
the base again, recomputes the fingerprint and refuses a different base in one line.

The checksum is exact and independent of the mesh: each leaf's bits (as unsigned ints)
summed modulo 2**32, plain and weighted by position, so the same base restored onto any
layout or device count has the same fingerprint.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax.app.config.parse import config_to_dict
from fsdp_jax.app.hf import peft
from fsdp_jax.app.hf.load import is_hf, open_init
from fsdp_jax.app.models import lora
from fsdp_jax.app.trainer.build import lora_spec
from fsdp_jax.app.trainer.qlora_load import load_quantised
from fsdp_jax.errors import CheckpointError
from fsdp_jax.train.state import TrainState


def _bits(x):
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint32}[x.dtype.itemsize]
    if x.dtype.itemsize == 8:
        x = x.astype(jnp.float32) if jnp.issubdtype(x.dtype, jnp.floating) else x.astype(jnp.int32)
    return jax.lax.bitcast_convert_type(x, width).astype(jnp.uint32).reshape(-1)


def _leaf_sums(x):
    b = _bits(x)
    pos = (jax.lax.iota(jnp.uint32, b.size) % jnp.uint32(65521)) + jnp.uint32(1)
    return jnp.stack([jnp.sum(b, dtype=jnp.uint32), jnp.sum(b * pos, dtype=jnp.uint32)])


def checksum(params) -> str:
    """A hex digest of `params`' tensors (bits, shapes, dtypes), the same on every mesh."""
    sums = np.asarray(jax.jit(lambda t: jnp.stack([_leaf_sums(x) for x in jax.tree.leaves(t)]))(params))
    meta = [(tuple(x.shape), str(x.dtype)) for x in jax.tree.leaves(params)]
    h = hashlib.sha256(repr(meta).encode())
    h.update(sums.astype("<u4").tobytes())
    return h.hexdigest()[:32]


def fingerprint(cfg, base) -> dict:
    """The base a LoRA run trains on: where it came from, its model config, its checksum."""
    return {
        "path": cfg.init_from,
        "config": config_to_dict(cfg)["model"],
        "checksum": checksum(base),
        "quant": _quant_label(cfg),
    }


def _quant_label(cfg) -> str:
    """The base's storage: "none" or the quantisation (`QuantSpec.label`, e.g. nf4/64/dq)."""
    spec = lora_spec(cfg)
    return "none" if spec is None or spec.base_quant is None else spec.base_quant.label


def check_fingerprint(saved: dict | None, now: dict, where: str) -> None:
    """CheckpointError (one line) unless the checkpoint's base is this run's."""
    if saved is None:
        raise CheckpointError(f"{where}: not a LoRA checkpoint (no lora_base); resume it without a lora: section")
    if saved.get("quant", "none") != now["quant"]:
        raise CheckpointError(
            f"{where}: its adapters were trained on a base quantised as {saved.get('quant', 'none')}; this run's "
            f"is {now['quant']} (set lora.base_quant / quant_block / double_quant as it was)"
        )
    if saved.get("checksum") != now["checksum"]:
        raise CheckpointError(
            f"{where}: its adapters were trained on another base ({saved.get('path')!r}, checksum "
            f"{saved.get('checksum')}); this run's base ({now['path']!r}) has checksum {now['checksum']}"
        )


def saved_state(state: TrainState) -> TrainState:
    """What a LoRA checkpoint holds: the state with the adapters as its params."""
    return state.replace(params=lora.split(state.params)[1])


def saved_abstract(abstract: TrainState) -> TrainState:
    """The restore target of a LoRA checkpoint (`saved_state` of the abstract state)."""
    return saved_state(abstract)


def _init_part(built, rng, pick: int):
    """The base (pick 0) or adapters (pick 1) of `built.model.init(rng)`, made shard by shard
    (the other part's init is dead code to XLA)."""
    target = lora.split(built.abstract_state.params)[pick]
    shardings = jax.tree.map(lambda s: s.sharding, target)

    def make(r):
        part = lora.split(built.model.init(r))[pick]
        return jax.tree.map(lambda x, s: x.astype(s.dtype), part, target)

    with jax.set_mesh(built.mesh):
        return jax.jit(make, out_shardings=shardings)(rng)


def base_params(built, rng, load: Callable[[Any], Any] | None, cfg=None):
    """The frozen base: `load(abstract base)` (init_from; a QLoRA run's quantised on the
    devices as it lands, `qlora_load`), else the model's own init."""
    if load is None:
        return _init_part(built, rng, 0)
    abstract = lora.split(built.abstract_state.params)[0]
    spec = None if cfg is None else lora_spec(cfg)
    if spec is not None and spec.base_quant is not None:
        ckpt = open_init(cfg.init_from, cfg.model) if is_hf(cfg.init_from) else None  # streamed layer by layer
        return load_quantised(load, abstract, spec.base_quant, 1 if cfg.model.scan_layers else 0, ckpt)
    return load(abstract)


def adapter_params(cfg, built, rng):
    """The adapters: `lora.init_from=peft:DIR`, else PEFT's init (A random, B zero)."""
    if not cfg.lora.init_from:
        return _init_part(built, rng, 1)
    host = peft.read_peft(cfg.lora.init_from.removeprefix("peft:"), cfg.model, lora_spec(cfg))
    target = lora.split(built.abstract_state.params)[1]
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x, s.dtype), s.sharding), host, target)


@dataclasses.dataclass
class LoraStart:
    """The params a LoRA run starts from and its base's fingerprint."""

    params: Any
    base: dict


def start(cfg, built, rng, load, adapters=None) -> LoraStart:
    """Base (loaded or initialised) joined with `adapters` (default: `adapter_params`)."""
    base = base_params(built, rng, load, cfg)
    fp = fingerprint(cfg, base)
    ad = adapter_params(cfg, built, rng) if adapters is None else adapters
    return LoraStart(lora.join(base, ad), fp)
