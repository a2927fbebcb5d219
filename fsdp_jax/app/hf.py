"""Hugging Face Llama-family checkpoints -> the reference Llama, loaded sharded.

    init_from: hf:/path/to/Llama-2-7b-hf       # config.json + model.safetensors[.index.json]

`model_config_from_hf` maps `config.json` onto `LlamaConfig` and refuses, with one
line naming the field, what the reference model cannot compute (another
activation, biases, sliding windows, rope scaling, a head_dim other than
hidden_size / heads, ...). Both config generations are read: transformers 5.x
writes `rope_parameters: {rope_theta, rope_type}`, 4.x a top-level `rope_theta`
(absent: 10000). `load_config` calls `model_section_from_hf` so a config with
`init_from: hf:PATH` gets its model section from the checkpoint (keys the YAML
sets must agree) and the run's saved config.yaml is complete.

Layout (measured against transformers' LlamaForCausalLM, DESIGN.md): per layer
`q/k/v_proj.weight.T` reshaped to (D, H, Dh), `o_proj.weight.T` to (H, Dh, D),
`gate/up/down_proj.weight.T`, norms as they are, the head `lm_head.weight.T` (or
the embedding table when tied). Both sides use rotate-half RoPE and map query head
n to kv head n // (H / K), so no permutation. Scanned layers stack on a leading
`layers` dim.

`load_params` builds each param leaf shard by shard: for every distinct index a
local device holds it reads just those rows/columns of the per-layer tensors
(`SafetensorsFile.read`), converts the dtype, puts it on the device(s) and drops
the host copy, so host memory holds one shard at a time, never the model.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fsdp_jax.app.config import ConfigError
from fsdp_jax.app.models.llama import LlamaConfig
from fsdp_jax.safetensors_io import SafetensorsError, SafetensorsFile
from fsdp_jax.checkpoint import CheckpointError, tree_paths

PREFIX = "hf:"
ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM")
MODEL_TYPES = ("llama", "mistral")
# LlamaConfig field <- config.json key (after rope/eps defaults are applied)
FIELDS = {"vocab_size": "vocab_size", "d_model": "hidden_size", "n_layers": "num_hidden_layers",
          "n_heads": "num_attention_heads", "n_kv_heads": "num_key_value_heads",
          "ffn_dim": "intermediate_size", "max_seq_len": "max_position_embeddings",
          "rope_theta": "rope_theta", "norm_eps": "rms_norm_eps",
          "tie_word_embeddings": "tie_word_embeddings"}
# per-layer params: our path under a block -> (HF name under model.layers.N, layout kind)
LAYER_TENSORS = {"attn/wq": ("self_attn.q_proj.weight", "qkv"),
                 "attn/wk": ("self_attn.k_proj.weight", "qkv"),
                 "attn/wv": ("self_attn.v_proj.weight", "qkv"),
                 "attn/wo": ("self_attn.o_proj.weight", "o"),
                 "mlp/w_gate": ("mlp.gate_proj.weight", "t"),
                 "mlp/w_up": ("mlp.up_proj.weight", "t"),
                 "mlp/w_down": ("mlp.down_proj.weight", "t"),
                 "attn_norm/scale": ("input_layernorm.weight", "id"),
                 "mlp_norm/scale": ("post_attention_layernorm.weight", "id")}
TOP_TENSORS = {"embed": ("model.embed_tokens.weight", "id"),
               "final_norm/scale": ("model.norm.weight", "id"),
               "head": ("lm_head.weight", "t")}
_FLOAT = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_IGNORED = re.compile(r"model\.layers\.\d+\.self_attn\.rotary_emb\.inv_freq")  # old 4.x buffers


def is_hf(init_from: str | None) -> bool:
    return isinstance(init_from, str) and init_from.startswith(PREFIX)


def hf_dir(init_from: str) -> Path:
    return Path(init_from[len(PREFIX):]).expanduser()


# -- config.json ---------------------------------------------------------------------------

def read_config_json(path: str | Path) -> dict:
    f = Path(path) / "config.json"
    try:
        raw = json.loads(f.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"hf:{path}: no config.json (expected a Hugging Face model "
                              "directory: config.json + model.safetensors)") from None
    except (OSError, ValueError) as e:
        raise ConfigError(str(f), f"not valid JSON ({e})") from None
    if not isinstance(raw, dict):
        raise ConfigError(str(f), "expected a JSON object")
    return raw


def model_config_from_hf(raw: Mapping, where: str = "config.json",
                         base: LlamaConfig = LlamaConfig()) -> LlamaConfig:
    """LlamaConfig for an HF config dict; non-architecture fields (scan_layers,
    attention) come from `base`. ConfigError(`where`, ...) names the refused field."""
    def bad(key, why):
        return ConfigError(where, f"{key}={raw.get(key)!r}: {why}")

    mt = raw.get("model_type")
    if mt not in MODEL_TYPES:
        raise bad("model_type", f"not a Llama-family model (allowed: {', '.join(MODEL_TYPES)})")
    arch = raw.get("architectures") or []
    if not isinstance(arch, list) or any(a not in ARCHITECTURES for a in arch):
        raise bad("architectures", f"allowed: {', '.join(ARCHITECTURES)}")
    act = raw.get("hidden_act", "silu")
    if act != "silu":
        raise bad("hidden_act", "the reference Llama's MLP is SwiGLU (silu) only")
    for key in ("attention_bias", "mlp_bias"):
        if raw.get(key, False):
            raise bad(key, "the reference Llama has no biases")
    if raw.get("sliding_window") is not None and raw.get("use_sliding_window", True):
        raise bad("sliding_window", "the reference Llama attends causally over the whole "
                  "sequence (allowed: null)")
    def number(key, default):
        v = raw.get(key, default)
        v = default if v is None else v
        if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
            raise bad(key, "expected a finite number")
        return float(v)
    if number("attention_dropout", 0.0) != 0.0:
        raise bad("attention_dropout", "the reference Llama has no dropout (allowed: 0)")
    if number("partial_rotary_factor", 1.0) != 1.0:
        raise bad("partial_rotary_factor", "RoPE rotates the whole head (allowed: 1)")
    rope = raw.get("rope_parameters") or {}
    if not isinstance(rope, Mapping):
        raise bad("rope_parameters", "expected an object {rope_type, rope_theta}")
    scaling = raw.get("rope_scaling")
    for key, r in (("rope_parameters", rope), ("rope_scaling", scaling or {})):
        kind = r.get("rope_type", r.get("type", "default")) if isinstance(r, Mapping) else r
        if kind != "default":
            raise bad(key, "rope scaling is not implemented by the reference Llama "
                      "(allowed: null or rope_type default)")
    theta = rope.get("rope_theta", raw.get("rope_theta", 10000.0))
    if "rope_theta" in rope and raw.get("rope_theta") is not None and raw["rope_theta"] != theta:
        raise bad("rope_theta", f"disagrees with rope_parameters.rope_theta={theta!r}")
    vals = {"rope_theta": theta, "rms_norm_eps": raw.get("rms_norm_eps", 1e-6),
            "tie_word_embeddings": raw.get("tie_word_embeddings", False),
            "num_key_value_heads": raw.get("num_key_value_heads") or raw.get("num_attention_heads"),
            "max_position_embeddings": raw.get("max_position_embeddings", 2048)}
    kw: dict[str, Any] = {}
    for field, key in FIELDS.items():
        v = vals[key] if key in vals else raw.get(key)
        if v is None:
            raise ConfigError(where, f"{key}: missing (a Llama config.json has it)")
        want = type(getattr(base, field))
        ok = (isinstance(v, bool) if want is bool else
              isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 2**31
              and math.isfinite(v) and (want is float or float(v).is_integer()))
        if not ok:
            raise ConfigError(where, f"{key}={v!r}: expected a "
                              f"{'boolean' if want is bool else 'finite positive number below 2**31'}"
                              f"{'' if want is not int else ', an integer'}")
        kw[field] = want(v)
    cfg = dataclasses.replace(base, **kw)
    if cfg.d_model % cfg.n_heads or cfg.n_heads % cfg.n_kv_heads:
        raise ConfigError(where, f"hidden_size={cfg.d_model}, num_attention_heads={cfg.n_heads}, "
                          f"num_key_value_heads={cfg.n_kv_heads}: heads must divide hidden_size "
                          "and kv heads must divide heads")
    hd = raw.get("head_dim")
    if hd is not None and hd != cfg.head_dim:
        raise bad("head_dim", f"the reference Llama's head dim is hidden_size / "
                  f"num_attention_heads = {cfg.head_dim}")
    return cfg


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
    for field, key in FIELDS.items():
        theirs, mine = getattr(derived, field), model.get(field)
        if isinstance(theirs, float) and isinstance(mine, str) and _FLOAT.fullmatch(mine.strip()):
            mine = float(mine)  # PyYAML reads 1e4 (no dot) as a string
        if field in model and mine != theirs:
            raise ConfigError(f"model.{field}", f"{model[field]!r} disagrees with "
                              f"{path / 'config.json'} ({key}={theirs!r}); remove it or make it agree")
        model[field] = theirs
    return {**raw, "model": model}


def check_model_config(model: LlamaConfig, path: Path) -> None:
    """ConfigError when `model` (the run's) differs from the checkpoint's config.json."""
    derived = model_config_from_hf(read_config_json(path), str(path / "config.json"), base=model)
    for field, key in FIELDS.items():
        if getattr(model, field) != getattr(derived, field):
            raise ConfigError(f"model.{field}", f"{getattr(model, field)!r} but {path}/config.json "
                              f"has {key}={getattr(derived, field)!r}")


# -- tensor layout -------------------------------------------------------------------------

def expected_tensors(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of a checkpoint for `cfg`."""
    d, f, dh = cfg.d_model, cfg.ffn_dim, cfg.head_dim
    per = {"self_attn.q_proj.weight": (cfg.n_heads * dh, d),
           "self_attn.k_proj.weight": (cfg.n_kv_heads * dh, d),
           "self_attn.v_proj.weight": (cfg.n_kv_heads * dh, d),
           "self_attn.o_proj.weight": (d, cfg.n_heads * dh),
           "mlp.gate_proj.weight": (f, d), "mlp.up_proj.weight": (f, d),
           "mlp.down_proj.weight": (d, f),
           "input_layernorm.weight": (d,), "post_attention_layernorm.weight": (d,)}
    out = {"model.embed_tokens.weight": (cfg.vocab_size, d)}
    for i in range(cfg.n_layers):
        out.update({f"model.layers.{i}.{k}": s for k, s in per.items()})
    out["model.norm.weight"] = (d,)
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = (cfg.vocab_size, d)
    return out


def leaf_sources(cfg: LlamaConfig) -> dict[str, tuple[list[str], str]]:
    """{our param path: ([HF names, one per stacked layer or a single one], kind)}.
    Scanned layers: "blocks/attn/wq" <- L names; else "blocks/3/attn/wq" <- one."""
    out: dict[str, tuple[list[str], str]] = {}
    for ours, (name, kind) in TOP_TENSORS.items():
        if ours != "head" or not cfg.tie_word_embeddings:
            out[ours] = ([name], kind)
    for ours, (name, kind) in LAYER_TENSORS.items():
        if cfg.scan_layers:
            out[f"blocks/{ours}"] = ([f"model.layers.{i}.{name}" for i in range(cfg.n_layers)], kind)
        else:
            for i in range(cfg.n_layers):
                out[f"blocks/{i}/{ours}"] = ([f"model.layers.{i}.{name}"], kind)
    return out


def _span(s: slice, n: int) -> tuple[int, int]:
    a, b, _ = s.indices(n)
    return a, b


def read_block(f: SafetensorsFile, name: str, kind: str, idx: tuple[slice, ...],
               shape: tuple[int, ...], dh: int, dtype) -> np.ndarray:
    """Our per-layer tensor of `shape`, sliced by `idx`, read from HF tensor `name`."""
    if kind == "id":
        return f.read(name, *idx, dtype=dtype)
    if kind == "t":  # ours (a, b) = w.T
        return f.read(name, idx[1], idx[0], dtype=dtype).T
    if kind == "qkv":  # ours (D, N, Dh) = w.T.reshape(D, N, Dh), w (N*Dh, D)
        n0, n1 = _span(idx[1], shape[1])
        w = f.read(name, slice(n0 * dh, n1 * dh), idx[0], dtype=dtype)  # (n*Dh, d)
        return w.reshape(n1 - n0, dh, -1)[:, idx[2], :].transpose(2, 0, 1)
    if kind == "o":  # ours (H, Dh, D) = w.T.reshape(H, Dh, D), w (D, H*Dh)
        h0, h1 = _span(idx[0], shape[0])
        w = f.read(name, idx[2], slice(h0 * dh, h1 * dh), dtype=dtype)  # (d, h*Dh)
        return w.reshape(-1, h1 - h0, dh)[:, :, idx[1]].transpose(1, 2, 0)
    raise ValueError(kind)


def to_hf(kind: str, ours: np.ndarray) -> np.ndarray:
    """One layer's tensor in HF layout (the inverse of `read_block` on the whole tensor)."""
    if kind == "id":
        return ours
    if kind == "t":
        return ours.T
    if kind == "qkv":
        return ours.reshape(ours.shape[0], -1).T
    if kind == "o":
        return ours.reshape(-1, ours.shape[-1]).T
    raise ValueError(kind)


# -- the checkpoint ------------------------------------------------------------------------

class HFCheckpoint:
    """A Hugging Face model directory, checked: config.json maps onto `LlamaConfig`,
    every shard file exists and parses, every tensor has the shape the config implies
    and none is unexpected. Raises ConfigError / CheckpointError (one line)."""

    def __init__(self, path: str | Path, base: LlamaConfig = LlamaConfig()):
        self.path = Path(path)
        where = str(self.path / "config.json")
        self.raw_config = read_config_json(self.path)
        self.config = model_config_from_hf(self.raw_config, where, base)
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
            raise CheckpointError(f"hf:{self.path}: no model.safetensors or "
                                  f"model.safetensors.index.json{hint}")
        files: dict[str, SafetensorsFile] = {}
        self.where: dict[str, SafetensorsFile] = {}
        for fname in sorted(set(weight_map.values()) if weight_map else {"model.safetensors"}):
            if not (self.path / fname).is_file():
                raise CheckpointError(f"hf:{self.path}: shard file {fname} listed in the index "
                                      "is missing")
            try:
                files[fname] = SafetensorsFile(self.path / fname)
            except SafetensorsError as e:
                raise CheckpointError(f"hf:{e}") from None
        for fname, f in files.items():
            for name in f.tensors:
                if weight_map is None or weight_map.get(name) == fname:
                    self.where[name] = f
        # before listing the tensors the config implies (a loop over its layers)
        held = 1 + max((int(m.group(1)) for n in self.where if (m := _LAYER.match(n))), default=-1)
        if held != self.config.n_layers:
            raise CheckpointError(f"hf:{self.path}: config.json num_hidden_layers="
                                  f"{self.config.n_layers}, but the tensors hold {held} layers")
        want = expected_tensors(self.config)
        missing = [n for n in want if n not in self.where]
        if missing:
            raise CheckpointError(f"hf:{self.path}: tensor {missing[0]} is missing"
                                  + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
        tied_head = self.config.tie_word_embeddings and "lm_head.weight" in self.where
        extra = [n for n in self.where if n not in want and not _IGNORED.fullmatch(n)
                 and not (tied_head and n == "lm_head.weight")]
        if extra:
            raise CheckpointError(f"hf:{self.path}: unexpected tensor {extra[0]} (the reference "
                                  "Llama has no such parameter)")
        for n, shape in want.items():
            got = self.where[n].shape(n)
            if got != shape:
                raise CheckpointError(f"hf:{self.path}: tensor {n} has shape {list(got)}, "
                                      f"config.json implies {list(shape)}")
            if self.where[n].dtype(n).name not in _FLOAT_DTYPES:
                raise CheckpointError(f"hf:{self.path}: tensor {n} has dtype "
                                      f"{self.where[n].dtype(n)}, expected a float type")

    def nbytes(self) -> int:
        """Bytes of the tensors the model uses, as stored."""
        want = expected_tensors(self.config)
        return sum(int(np.prod(s)) * self.where[n].dtype(n).itemsize for n, s in want.items())

    def read(self, names: list[str], kind: str, idx: tuple[slice, ...], shape: tuple[int, ...],
             dtype, stacked: bool) -> np.ndarray:
        """The block `idx` of our leaf of `shape` (stacked: leading layer dim over `names`)."""
        dh = self.config.head_dim
        if not stacked:
            return read_block(self.where[names[0]], names[0], kind, idx, shape, dh, dtype)
        l0, l1 = _span(idx[0], shape[0])
        return np.stack([read_block(self.where[names[i]], names[i], kind, idx[1:], shape[1:], dh,
                                    dtype) for i in range(l0, l1)])


def load_params(ckpt: HFCheckpoint, abstract_params) -> Any:
    """Params laid out as `abstract_params` (ShapeDtypeStructs with shardings, the
    reference Llama's tree for `ckpt.config`), each process reading only the slices
    its devices hold, cast to each leaf's dtype on the way."""
    sources = leaf_sources(ckpt.config)
    want = tree_paths(abstract_params)
    if set(want) != set(sources):
        diff = sorted(set(want) ^ set(sources))
        raise CheckpointError(f"hf:{ckpt.path}: the model's params do not match the checkpoint "
                              f"layout ({', '.join(diff[:4])})")
    leaves = []
    for path, sds in want.items():
        names, kind = sources[path]
        stacked = len(names) > 1 or (ckpt.config.scan_layers and path.startswith("blocks/"))
        shape, dtype = tuple(sds.shape), np.dtype(sds.dtype)
        sharding = getattr(sds, "sharding", None)
        if sharding is None:
            whole = tuple(slice(0, n) for n in shape)
            leaves.append(jax.numpy.asarray(ckpt.read(names, kind, whole, shape, dtype, stacked)))
            continue
        groups: dict[tuple, list] = {}  # distinct index -> devices holding it
        for dev, idx in sharding.addressable_devices_indices_map(shape).items():
            key = tuple(s.indices(n)[:2] for s, n in zip(idx, shape))
            groups.setdefault(key, []).append(dev)
        arrays = []
        for key, devs in groups.items():
            block = ckpt.read(names, kind, tuple(slice(a, b) for a, b in key), shape, dtype, stacked)
            arrays += [jax.device_put(block, d) for d in devs]
            del block  # one host block at a time
        leaves.append(jax.make_array_from_single_device_arrays(shape, sharding, arrays))
    return jax.tree.unflatten(jax.tree.structure(abstract_params), leaves)


def open_init(init_from: str, model: LlamaConfig) -> HFCheckpoint:
    """The checked checkpoint of `init_from: hf:PATH` for a run whose model config is
    `model` (ConfigError when it differs from config.json)."""
    path = hf_dir(init_from)
    check_model_config(model, path)
    return HFCheckpoint(path, base=model)
