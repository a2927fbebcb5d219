"""Hugging Face checkpoints of the decoder families -> the reference decoder, loaded sharded.

    init_from: hf:/path/to/Llama-3.1-8B       # config.json + model.safetensors[.index.json]

`model_config_from_hf` (fsdp_jax.app.hf.config_in) maps `config.json` of a registered
family (`fsdp_jax.app.models.families`) onto `DecoderConfig` and refuses, with one
line naming the field, what the decoder cannot compute. `load_config` calls
`model_section_from_hf` so a config with `init_from: hf:PATH` gets its model section
from the checkpoint (keys the YAML sets must agree) and the run's saved config.yaml is
complete. `HFCheckpoint` then checks every tensor against what the config implies
(a bias the config does not have, a q_norm of the wrong size: one line naming it).

Layout: each family's module names its tensors (`Family.weights`, `moe_names`,
`moe_weights`); per layer `q/k/v_proj.weight.T` reshaped to (D, H, Dh), `o_proj.weight.T`
to (H, Dh, D), `gate/up/down_proj.weight.T`, norms as they are, q/k/v biases reshaped to
(N, Dh), the head `lm_head.weight.T` (or the embedding table when tied). Both sides use
rotate-half RoPE and map query head n to kv head n // (H / K), so no permutation. Scanned
layers stack on a leading `layers` dim.

`load_params` builds each param leaf shard by shard: for every distinct index a
local device holds it reads just those rows/columns of the per-layer tensors
(`SafetensorsFile.read`), converts the dtype, puts it on the device(s) and drops
the host copy, so host memory holds one shard at a time, never the model.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fsdp_jax.app.hf import fp8_blocks, moe_layout, mtp_fresh, mtp_layout, mxfp4
from fsdp_jax.app.hf.config_in import ARCH_FIELDS, FIELDS, model_config_from_hf
from fsdp_jax.app.hf.layouts import read_block, span
from fsdp_jax.app.models import families
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.checkpoint import CheckpointError, tree_paths
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile
from fsdp_jax.errors import ConfigError, SafetensorsError

PREFIX = "hf:"
# per-layer params: each family's weight names (fsdp_jax.app.models.families), by switch
TOP_TENSORS = {
    "embed": ("model.embed_tokens.weight", "id"),
    "final_norm/scale": ("model.norm.weight", "id"),
    "head": ("lm_head.weight", "t"),
}
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # old 4.x buffers


def is_hf(init_from: str | None) -> bool:
    return isinstance(init_from, str) and init_from.startswith(PREFIX)


def hf_dir(init_from: str) -> Path:
    return Path(init_from[len(PREFIX) :]).expanduser()


# -- config.json ---------------------------------------------------------------------------


def read_config_json(path: str | Path) -> dict:
    f = Path(path) / "config.json"
    try:
        raw = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(
            f"hf:{path}: no config.json (expected a Hugging Face model directory: config.json + model.safetensors)"
        ) from None
    except (OSError, ValueError) as e:
        raise ConfigError(str(f), f"not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(str(f), "expected a JSON object")
    return raw


def model_section_from_hf(raw: Mapping) -> dict:
    """A raw config dict whose `model` section is filled from `init_from: hf:PATH`'s
    config.json (when that file exists; else unchanged). A model key the YAML sets
    that disagrees with the checkpoint is a ConfigError naming both."""
    init_from = raw.get("init_from")
    if not is_hf(init_from) or not (hf_dir(init_from) / "config.json").is_file():
        return dict(raw)
    path = hf_dir(init_from)
    section = raw.get("model") or {}
    if not isinstance(section, Mapping):
        return dict(raw)  # config_from_dict reports it
    derived = model_config_from_hf(read_config_json(path), str(path / "config.json"))
    model = dict(section)
    for field in ARCH_FIELDS:
        key = FIELDS.get(field, field)
        theirs, mine = getattr(derived, field), model.get(field)
        if isinstance(theirs, float) and isinstance(mine, str) and _FLOAT.fullmatch(mine.strip()):
            mine = float(mine)  # PyYAML reads 1e4 (no dot) as a string
        if isinstance(theirs, tuple) and isinstance(mine, list):
            mine = tuple(mine)  # a run's saved config.yaml writes tuples as YAML lists
        if field in model and mine != theirs:
            raise ConfigError(
                f"model.{field}",
                f"{model[field]!r} disagrees with "
                f"{path / 'config.json'} ({key}={theirs!r}); remove it or make it agree",
            )
        model[field] = theirs
    return {**raw, "model": model}


def check_model_config(model: DecoderConfig, path: Path) -> None:
    """ConfigError when `model` (the run's) differs from the checkpoint's config.json."""
    derived = model_config_from_hf(read_config_json(path), str(path / "config.json"), base=model)
    for field in ARCH_FIELDS:
        if getattr(model, field) != getattr(derived, field):
            raise ConfigError(
                f"model.{field}",
                f"{getattr(model, field)!r} but {path}/config.json "
                f"implies {FIELDS.get(field, field)}={getattr(derived, field)!r}",
            )


# -- tensor layout -------------------------------------------------------------------------


def layer_tensors(cfg: DecoderConfig) -> dict[str, tuple[str, str]]:
    """{our path under a block: (HF name under model.layers.N, layout kind)} for `cfg`:
    the names each registered family brings for the switches `cfg` has on."""
    return families.weight_names(cfg)


def expected_tensors(cfg: DecoderConfig) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of a checkpoint for `cfg`."""
    d, f, dh = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    shapes = {
        "attn/wq": (cfg.n_heads * dh, d),
        "attn/wk": (cfg.n_kv_heads * dh, d),
        "attn/wv": (cfg.n_kv_heads * dh, d),
        "attn/wo": (d, cfg.n_heads * dh),
        "mlp/w_gate": (f, d),
        "mlp/w_up": (f, d),
        "mlp/w_down": (d, f),
        "attn/bq": (cfg.n_heads * dh,),
        "attn/bk": (cfg.n_kv_heads * dh,),
        "attn/bv": (cfg.n_kv_heads * dh,),
        "attn/q_norm/scale": (dh,),
        "attn/k_norm/scale": (dh,),
    }
    shapes.update({ours: shape for ours, (_, _, shape) in families.part_tensors(cfg).items()})
    per = {name: shapes.get(ours, (d,)) for ours, (name, _) in layer_tensors(cfg).items()}
    out = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    if cfg.n_experts:  # sparse and dense layers
        shapes.update({k: (d,) for k in layer_tensors(cfg) if k not in shapes})
        out.update(moe_layout.expected(cfg, layer_tensors(cfg), shapes))
    for i in range(0 if cfg.n_experts else cfg.n_layers):
        out.update({f"model.layers.{i}.{k}": s for k, s in per.items()})
    out.update(mtp_layout.expected(cfg, layer_tensors(cfg), shapes))
    out["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


def leaf_sources(cfg: DecoderConfig) -> dict[str, tuple[list[str], str]]:
    """{our param path: ([HF names, one per stacked layer or a single one], kind)}.
    Scanned layers: "blocks/attn/wq" <- L names; else "blocks/3/attn/wq" <- one."""
    out: dict[str, tuple[list[str], str]] = {}
    for ours, (name, kind) in TOP_TENSORS.items():
        if ours != "head" or not cfg.tie_word_embeddings:
            out[ours] = ([name], kind)
    out.update(mtp_layout.leaf_sources(cfg, layer_tensors(cfg)))  # MTP modules (a family with their layout)
    if cfg.n_experts:
        return {**out, **moe_layout.leaf_sources(cfg, layer_tensors(cfg))}
    for ours, (name, kind) in layer_tensors(cfg).items():
        if cfg.scan_layers:
            out[f"blocks/{ours}"] = ([f"model.layers.{i}.{name}" for i in range(cfg.n_layers)], kind)
        else:
            for i in range(cfg.n_layers):
                out[f"blocks/{i}/{ours}"] = ([f"model.layers.{i}.{name}"], kind)
    return out


# -- the checkpoint ------------------------------------------------------------------------


class HFCheckpoint:
    """A Hugging Face model directory, checked: config.json maps onto `DecoderConfig`,
    every shard file exists and parses, every tensor has the shape the config implies
    and none is unexpected. Raises ConfigError / CheckpointError (one line)."""

    def __init__(self, path: str | Path, base: DecoderConfig = DecoderConfig()):
        self.path = Path(path)
        where = str(self.path / "config.json")
        self.raw_config = read_config_json(self.path)
        self.config = model_config_from_hf(self.raw_config, where, base)
        self.mxfp4 = mxfp4.quantized(self.raw_config, lambda k, why: ConfigError(where, f"{k}: {why}"))
        self.fp8 = fp8_blocks.block_size(self.raw_config, lambda k, why: ConfigError(where, f"{k}: {why}"))
        self.where: dict[str, SafetensorsFile] = self._open_files()
        # before listing the tensors the config implies (a loop over its layers)
        held = 1 + max((int(m.group(1)) for n in self.where if (m := _LAYER.match(n))), default=-1)
        mtp = mtp_layout.held(self.raw_config, self.config)  # MTP layers follow the decoder's
        if held != self.config.n_layers + mtp:
            raise CheckpointError(
                f"hf:{self.path}: config.json num_hidden_layers="
                f"{self.config.n_layers}{f' + {mtp} MTP' if mtp else ''}, but the tensors hold {held} layers"
            )
        # the model the checkpoint holds: MTP depths past its own start fresh (`mtp_fresh`)
        self.mtp_held = mtp
        self.stored = dataclasses.replace(self.config, mtp_depth=min(self.config.mtp_depth, mtp))
        want = self.want = self._expected()
        missing = [n for n in want if n not in self.where]
        if missing:
            raise CheckpointError(
                f"hf:{self.path}: tensor {missing[0]} is missing"
                + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else "")
            )
        tied_head = self.config.tie_word_embeddings and "lm_head.weight" in self.where
        extra = [
            n
            for n in self.where
            if n not in want
            and not _IGNORED.fullmatch(n)
            and not (tied_head and n == "lm_head.weight")
            and not (self.fp8 and n.endswith(fp8_blocks.SCALE) and n.removesuffix(fp8_blocks.SCALE) in want)
            and not mtp_layout.ignored(n, self.config, mtp)
        ]
        if extra:
            raise CheckpointError(
                f"hf:{self.path}: unexpected tensor {extra[0]} (the model config.json describes has no such parameter)"
            )
        for n, shape in want.items():
            got = self.where[n].shape(n)
            if got != shape:
                raise CheckpointError(
                    f"hf:{self.path}: tensor {n} has shape {list(got)}, config.json implies {list(shape)}"
                )
            if self.fp8 and n + fp8_blocks.SCALE in self.where:  # block-scaled FP8, dequantised on read
                problem = fp8_blocks.problem(n, self.where[n], self.where[n + fp8_blocks.SCALE], shape, self.fp8)
                if problem:
                    raise CheckpointError(f"hf:{self.path}: {problem}")
                continue
            packed = self.mxfp4 and n.endswith((mxfp4.BLOCKS, mxfp4.SCALES))
            if self.where[n].dtype(n).name not in (("uint8",) if packed else _FLOAT_DTYPES):
                raise CheckpointError(
                    f"hf:{self.path}: tensor {n} has dtype {self.where[n].dtype(n)}, "
                    f"expected {'uint8 (MXFP4)' if packed else 'a float type'}"
                )

    def _open_files(self) -> dict[str, SafetensorsFile]:
        """{HF tensor name: its open shard file}, from the index (or the one model.safetensors)."""
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
                if not isinstance(weight_map, dict):
                    raise TypeError("weight_map is not an object")
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"hf:{self.path}: invalid {index.name} ({e})") from None
        elif (self.path / "model.safetensors").is_file():
            weight_map = None
        else:
            other = sorted(p.name for p in self.path.glob("*.bin"))
            hint = f" (found {', '.join(other)}: convert it to safetensors first)" if other else ""
            raise CheckpointError(f"hf:{self.path}: no model.safetensors or model.safetensors.index.json{hint}")
        files: dict[str, SafetensorsFile] = {}
        where: dict[str, SafetensorsFile] = {}
        for fname in sorted(set(weight_map.values()) if weight_map else {"model.safetensors"}):
            if not (self.path / fname).is_file():
                raise CheckpointError(f"hf:{self.path}: shard file {fname} listed in the index is missing")
            try:
                files[fname] = SafetensorsFile(self.path / fname)
            except SafetensorsError as e:
                raise CheckpointError(f"hf:{e}") from None
        for fname, f in files.items():
            for name in f.tensors:
                if weight_map is None or weight_map.get(name) == fname:
                    where[name] = f
        return where

    def _expected(self) -> dict[str, tuple[int, ...]]:
        """{HF tensor name: shape} this checkpoint must hold (MXFP4 pairs where it says so)."""
        want = expected_tensors(self.stored)
        if not self.mxfp4:
            return want
        names = {n for names, kind in leaf_sources(self.stored).values() if kind == mxfp4.KIND for n in names}
        want, problem = mxfp4.stored(want, names)
        if problem:
            raise CheckpointError(f"hf:{self.path}: {problem}")
        return want

    def nbytes(self) -> int:
        """Bytes of the tensors the model uses, as stored."""
        return sum(int(np.prod(s)) * self.where[n].dtype(n).itemsize for n, s in self.want.items())

    def read(
        self, names: list[str], kind: str, idx: tuple[slice, ...], shape: tuple[int, ...], dtype, stacked: bool
    ) -> np.ndarray:
        """The block `idx` of our leaf of `shape` (stacked: leading layer dim over `names`)."""
        dh = self.config.head_dim
        if stacked:
            l0, l1 = span(idx[0], shape[0])
            return np.stack([self.read([names[i]], kind, idx[1:], shape[1:], dtype, False) for i in range(l0, l1)])
        if kind.startswith(moe_layout.EXPERT_KIND):  # one HF tensor per expert, stacked
            e0, e1 = span(idx[0], shape[0])
            base = kind[len(moe_layout.EXPERT_KIND) :]
            return np.stack(
                [self.read([names[0].format(e=e)], base, idx[1:], shape[1:], dtype, False) for e in range(e0, e1)]
            )
        if kind == mxfp4.KIND and self.mxfp4:
            n = names[0]
            return mxfp4.read_block(self.where[n + mxfp4.BLOCKS], self.where[n + mxfp4.SCALES], n, idx, shape, dtype)
        n = names[0]
        f = self.where[n]
        if self.fp8 and n + fp8_blocks.SCALE in self.where:
            f = fp8_blocks.Fp8Weight(f, self.where[n + fp8_blocks.SCALE], self.fp8)
        return read_block(f, n, kind, idx, shape, dh, dtype)


def load_params(
    ckpt: HFCheckpoint, abstract_params, skip: frozenset[str] = frozenset(), fresh: Callable | None = None
) -> Any:
    """Params laid out as `abstract_params` (ShapeDtypeStructs with shardings, the
    reference decoder's tree for `ckpt.config`), each process reading only the slices
    its devices hold, cast to each leaf's dtype on the way; the leaves at `skip` (paths as
    `tree_paths` names them) are left as None (a caller streams them: `load_layer`). The MTP
    depths the checkpoint lacks come from `fresh(paths) -> {path: array}`
    (`mtp_fresh.initialiser`); without it such a checkpoint is refused (one line)."""
    sources = leaf_sources(ckpt.stored)
    want = tree_paths(abstract_params)
    new = mtp_fresh.fresh_paths(want, mtp_fresh.missing_depths(ckpt.config.mtp_depth, ckpt.mtp_held))
    if new and fresh is None:
        raise ConfigError(
            "model.mtp_depth",
            f"{ckpt.config.mtp_depth}, but hf:{ckpt.path} holds {ckpt.mtp_held} MTP layers (no fresh init given)",
        )
    if set(want) - set(new) != set(sources):
        diff = sorted((set(want) - set(new)) ^ set(sources))
        raise CheckpointError(
            f"hf:{ckpt.path}: the model's params do not match the checkpoint layout ({', '.join(diff[:4])})"
        )
    made = fresh([p for p in new if p not in skip]) if new else {}
    leaves = []
    for path, sds in want.items():
        if path in new:
            leaves.append(made.get(path))
            continue
        names, kind = sources[path]
        stacked = len(names) > 1 or moe_layout.is_stacked(ckpt.config, path)
        leaves.append(
            None if path in skip else _placed(functools.partial(ckpt.read, names, kind, stacked=stacked), sds)
        )
    return jax.tree.unflatten(jax.tree.structure(abstract_params), leaves)


def load_layer(ckpt: HFCheckpoint, path: str, layer: int, sds) -> jax.Array:
    """Layer `layer` of the stacked leaf at `path`, laid out as `sds` (that layer's shape,
    dtype and sharding): only this layer's slices are read, so a caller that quantises each
    layer as it lands holds one layer on the host at a time."""
    names, kind = leaf_sources(ckpt.stored)[path]
    return _placed(functools.partial(ckpt.read, [names[layer]], kind, stacked=False), sds)


def _placed(read, sds) -> jax.Array:
    """`read(idx, shape, dtype)` block by block onto `sds`' devices: one host block at a time."""
    shape, dtype = tuple(sds.shape), np.dtype(sds.dtype)
    sharding = getattr(sds, "sharding", None)
    if sharding is None:
        # device_put, not jnp.asarray: that lifts a host array by a compiled `stage` program per shape
        return jax.device_put(read(tuple(slice(0, n) for n in shape), shape, dtype))
    groups: dict[tuple, list] = {}  # distinct index -> devices holding it
    for dev, idx in sharding.addressable_devices_indices_map(shape).items():
        key = tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
        groups.setdefault(key, []).append(dev)
    arrays = []
    for key, devs in groups.items():
        block = read(tuple(slice(a, b) for a, b in key), shape, dtype)
        arrays += [jax.device_put(block, d) for d in devs]
        del block  # one host block at a time
    return jax.make_array_from_single_device_arrays(shape, sharding, arrays)


def open_init(init_from: str, model: DecoderConfig) -> HFCheckpoint:
    """The checked checkpoint of `init_from: hf:PATH` for a run whose model config is
    `model` (ConfigError when it differs from config.json)."""
    path = hf_dir(init_from)
    check_model_config(model, path)
    return HFCheckpoint(path, base=model)
