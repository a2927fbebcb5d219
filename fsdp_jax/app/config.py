"""Typed, frozen run configuration: one dataclass per section, YAML in, YAML out.

    cfg = load_config("configs/tiny.yaml", ["train.steps=20", "mesh.strategy=no_shard"])
    validate(cfg, n_devices=8)      # checks that need the device count
    check_data(cfg)                 # after the trainer prepared the corpus, if it does

Every error is a `ConfigError` whose message is one line naming the dotted key, the
bad value and what is allowed. YAML is read with `yaml.safe_load` only.
"""

from __future__ import annotations

import dataclasses
import difflib
import importlib.util
import json
import math
import os
import re
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fsdp_jax import rules as rl
from fsdp_jax.axes import MESH_AXES
from fsdp_jax.mesh import MeshError, resolve_mesh_shape
from fsdp_jax.precision import Policy
from fsdp_jax.app.models.llama import LlamaConfig, count_params  # noqa: F401 (re-exported)
from fsdp_jax.app.models.rope import ROPE_TYPES
from fsdp_jax.offload import OFFLOADS
from fsdp_jax.remat import REMAT_POLICIES
from fsdp_jax.strategy import ALIASES, STRATEGIES
from fsdp_jax.errors import ConfigError  # noqa: F401 (re-exported)


# The model section is the reference model's own config dataclass.
ModelConfig = LlamaConfig


Rules = dict[str, Any]


def resolved_rules(overrides: Mapping | None = None) -> Rules:
    """`overrides` (logical name -> mesh axis, list of axes, or null) merged over
    `fsdp_jax.rules.DEFAULT_RULES`, in YAML-friendly form (lists, not tuples).
    Raises ConfigError naming mesh.rules.NAME when a value is not a mesh axis."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError("mesh.rules", f"{overrides!r} is not a mapping of logical name -> mesh "
                          "axis (e.g. {mlp: tensor, embed: fsdp})")
    out = {}
    for name, value in {**rl.DEFAULT_RULES, **(overrides or {})}.items():
        try:
            merged = rl.merge_rules({name: value}, {})
        except rl.ShardingError:
            raise ConfigError(f"mesh.rules.{name}", f"{value!r} is invalid; a mesh axis "
                              f"({', '.join(MESH_AXES)}), a list of them, or null") from None
        v = merged[str(name)]
        out[str(name)] = list(v) if isinstance(v, tuple) else v
    return out


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = 1                       # each size >= 1, or -1 (one axis) = the remaining devices
    fsdp: int = -1
    tensor: int = 1
    strategy: str = "full_shard"        # a name of fsdp_jax.strategy.STRATEGIES or an alias
    min_shard_size: int = 16384         # leaves with fewer elements stay replicated
    max_replicated_fraction: float = 0.02
    min_replicated_bytes: int = rl.DEFAULT_MIN_REPLICATED_BYTES  # under this, over the fraction only warns
    # logical name -> mesh axis / list / null, merged over fsdp_jax.rules.DEFAULT_RULES (the
    # resolved table is what the run saves in config.yaml)
    rules: Rules = dataclasses.field(default_factory=resolved_rules)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = "adamw"                 # adamw | sgd | adafactor
    lr: float = 3e-3                    # peak; linear warmup then cosine to lr * min_lr_ratio
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    momentum: float = 0.9               # sgd only
    clip_norm: float | None = 1.0       # global-norm clipping; null = off


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str = "data/stdlib"           # directory with train.bin, val.bin, meta.json
    source: str = "stdlib"              # stdlib: prepare the stdlib corpus there if missing; none
    seq_len: int = 128
    seed: int = 0
    document_mask: bool = False         # token corpora: attention and positions restart after each EOS


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = 500
    global_batch: int = 16              # sequences per step, over all processes and microbatches
    microbatches: int = 1               # gradient accumulation
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100               # 0 = never
    eval_batches: int = 8
    checkpoint_every: int = 100         # 0 = only at the end
    keep_checkpoints: int = 3
    tensorboard: bool = False
    sample_tokens: int = 200            # generated after training; 0 = none
    max_inflight_steps: int = 1         # steps dispatched before blocking on a loss
    max_nonfinite_steps: int = 3        # skipped (non-finite) steps in a row before the run stops
    profile: str | None = None          # "START:END": jax.profiler trace of those steps (1-based) -> run_dir/profile


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    wandb: bool = False                 # also log metrics.jsonl's records to Weights & Biases (WANDB_MODE=offline works)
    wandb_project: str = "fsdp_jax"
    wandb_run_name: str | None = None   # null = W&B picks one


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str | None = None      # host:port of process 0; null = auto-detect (SLURM, Open MPI, ...)
    num_processes: int | None = None
    process_id: int | None = None
    init_timeout_s: int = 300


@dataclasses.dataclass(frozen=True)
class Config:
    model: ModelConfig = ModelConfig()
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    distributed: DistributedConfig = DistributedConfig()
    logging: LoggingConfig = LoggingConfig()
    precision: str = "params=float32,compute=float32"
    remat: str = "dots"
    offload: str = "none"               # none | optimizer | optimizer+params: state kept in host memory
    run_dir: str = "runs/tiny"
    xla_gpu_flags: str = "none"         # none | fsdp: fsdp_jax.xla_flags.GPU_FSDP_FLAGS (set before start-up)
    init_from: str | None = None        # params to start from: a .safetensors file, run or checkpoint dir,
                                        # or hf:DIR (a Hugging Face model, docs/hf_models.md; its config.json sets model.*)


_SECTIONS: dict[str, type] = {k: t for k, t in typing.get_type_hints(Config).items()
                              if dataclasses.is_dataclass(t)}
_OVERRIDE_ALIASES = {"strategy": "mesh.strategy", "steps": "train.steps", "lr": "optimizer.lr"}
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_INT_LIMIT = 2**31
_CHOICES = {"model.attention": ("xla", "cudnn"), "model.rope_type": ROPE_TYPES,
            "model.mlp_activation": ("silu", "gelu_pytorch_tanh"), "optimizer.name": ("adamw", "sgd", "adafactor"),
            "data.source": ("stdlib", "none"), "xla_gpu_flags": ("none", "fsdp")}


def _all_keys() -> list[str]:
    keys = []
    for f in dataclasses.fields(Config):
        sub = _SECTIONS.get(f.name)
        keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(sub)] if sub else [f.name]
    return keys


def _unknown(key: str, candidates: Sequence[str],
             shown: Sequence[str] | None = None) -> ConfigError:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"allowed: {', '.join(shown or candidates)}"
    return ConfigError(key, f"unknown key; {hint}")


def _coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; int -> float and '3e-3' -> 0.003 for floats."""
    args = typing.get_args(tp)
    if type(None) in args:
        if value is None:
            return None
        tp = next(a for a in args if a is not type(None))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"{value!r} is not a boolean; use true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -_INT_LIMIT <= value < _INT_LIMIT:  # seeds, sizes and steps reach int32/C long
                raise ConfigError(key, f"{value!r} is out of range; must be in [-2**31, 2**31)")
            return value
        raise ConfigError(key, f"{value!r} is not an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value) if abs(value) < 1e308 or isinstance(value, float) else math.inf
        elif isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            out = float(value)  # PyYAML reads 3e-3 (no dot) as a string
        else:
            raise ConfigError(key, f"{value!r} is not a number")
        if not math.isfinite(out):  # .inf / .nan would only surface as NaN params
            raise ConfigError(key, f"{value!r} is not a finite number")
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        hint = " (quote it in YAML: an unquoted 2:4 reads as a base-60 number)" if isinstance(value, int) else ""
        raise ConfigError(key, f"{value!r} is not a string{hint}")
    if tp == Rules:
        return resolved_rules(value)
    raise TypeError(f"{key}: unsupported annotation {tp!r}")  # a bug here, not in the YAML


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(prefix, f"expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in raw:
        if k not in hints:
            raise _unknown(f"{prefix}.{k}", [f"{prefix}.{n}" for n in names])
    return cls(**{k: _coerce(f"{prefix}.{k}", v, hints[k]) for k, v in raw.items()})


# Paths a user may write as ~/x (as a shell would expand them); init_from also as hf:~/x.
_PATH_KEYS = (("run_dir",), ("data", "path"), ("init_from",))


def expand_user_paths(d: Mapping) -> dict:
    """A copy of the raw config dict with a leading `~` expanded in its path keys."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in d.items()}
    for keys in _PATH_KEYS:
        holder = out if len(keys) == 1 else out.get(keys[0])
        v = holder.get(keys[-1]) if isinstance(holder, dict) else None
        if isinstance(v, str):
            prefix = "hf:" if v.startswith("hf:") else ""
            holder[keys[-1]] = prefix + os.path.expanduser(v[len(prefix):])
    return out


def config_from_dict(d: Mapping) -> Config:
    """Build a Config from plain nested mappings (missing keys take defaults) and validate it."""
    if not isinstance(d, Mapping):
        raise ConfigError("config", f"expected a mapping at the top level, got {type(d).__name__}")
    d = expand_user_paths(d)
    hints = typing.get_type_hints(Config)
    kwargs = {}
    for k, v in d.items():
        if k not in hints:
            raise _unknown(str(k), list(hints))
        if k in _SECTIONS:
            kwargs[k] = _build(hints[k], {} if v is None else v, k)
        else:
            kwargs[k] = _coerce(k, v, hints[k])
    cfg = Config(**kwargs)
    validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict (yaml.safe_dump-able); config_from_dict(config_to_dict(c)) == c."""
    return dataclasses.asdict(cfg)


def save_config(cfg: Config, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def _field_type(dotted: str) -> Any:
    head, _, tail = dotted.partition(".")
    hints = typing.get_type_hints(Config)
    if head in _SECTIONS and tail:
        return typing.get_type_hints(_SECTIONS[head]).get(tail)
    return None if tail else hints.get(head)


def apply_overrides(raw: Mapping, overrides: Sequence[str]) -> dict:
    """Return a copy of the raw config dict with `key=value` overrides applied."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = _OVERRIDE_ALIASES.get(key.strip(), key.strip())
        if not sep or not key:
            raise ConfigError("override", f"{item!r} is not key=value (e.g. train.steps=20)")
        if key in _SECTIONS:
            raise ConfigError(key, f"is a section; override one of its keys ({key}.KEY=VALUE)")
        if key.startswith("mesh.rules.") and len(key) > len("mesh.rules."):
            try:  # one rule: mesh.rules.mlp=tensor, mesh.rules.batch=[data,fsdp], mesh.rules.kv=null
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                raise ConfigError(key, f"cannot parse value {text!r}") from None
            mesh_ = out.setdefault("mesh", {})
            if not isinstance(mesh_, dict):
                raise ConfigError("mesh", f"expected a mapping of keys, got {mesh_!r}")
            rules_ = mesh_.get("rules") or {}
            if not isinstance(rules_, Mapping):
                raise ConfigError("mesh.rules", f"{rules_!r} is not a mapping")
            mesh_["rules"] = {**rules_, key[len("mesh.rules."):]: value}
            continue
        tp = _field_type(key)
        if tp is None:
            head = key.partition(".")[0]
            shown = ([f"{head}.{f.name}" for f in dataclasses.fields(_SECTIONS[head])]
                     if head in _SECTIONS else
                     [f"{k}.KEY" if k in _SECTIONS else k for k in typing.get_type_hints(Config)])
            raise _unknown(key, _all_keys(), shown)
        if tp in (str, str | None):  # keep strings verbatim: 'a: b' or '1,2' must not become YAML
            value = None if tp != str and text.strip() in ("null", "~", "None", "") else text
        else:
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                raise ConfigError(key, f"cannot parse value {text!r}") from None
        head, _, tail = key.partition(".")
        if tail:
            section = out.setdefault(head, {})
            if not isinstance(section, dict):
                raise ConfigError(head, f"expected a mapping of keys, got {section!r}")
            section[tail] = value
        else:
            out[head] = value
    return out


def load_config(path: str | Path, overrides: Sequence[str] = ()) -> Config:
    """Read a YAML config, apply `key=value` overrides, build and validate (no device checks)."""
    path = Path(path)
    if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO or device would block
        raise ConfigError(str(path), "is not a regular file")
    try:
        raw = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(str(path), "config file not found") from None
    except IsADirectoryError:
        raise ConfigError(str(path), "is a directory, not a YAML config file") from None
    except OSError as e:
        raise ConfigError(str(path), f"cannot read config file ({e.strerror})") from None
    except UnicodeDecodeError as e:
        raise ConfigError(str(path), f"not a UTF-8 text file (byte {e.start}: "
                          f"{e.object[e.start:e.start + 1]!r})") from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise ConfigError(str(path), f"YAML syntax error{at}: "
                          f"{getattr(e, 'problem', None) or 'invalid YAML'}") from None
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(str(path), f"top level must be a mapping of sections, got "
                          f"{type(raw).__name__}")
    from fsdp_jax.app.hf import model_section_from_hf  # init_from=hf:PATH fills the model section
    return config_from_dict(model_section_from_hf(expand_user_paths(apply_overrides(raw, overrides))))


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, f"{value!r} is invalid; {allowed}")


def _check_decoder(m: LlamaConfig) -> None:
    """The family switches of the decoder (docs/hf_models.md)."""
    for n in ("sliding_window", "global_every", "rope_local_theta", "attn_softcap",
              "query_pre_attn_scalar", "final_softcap", "rope_attention_factor", "rope_mscale",
              "rope_mscale_all_dim", "rope_original_max_len"):
        _check(getattr(m, n) >= 0, f"model.{n}", getattr(m, n), "must be >= 0 (0 = off)")
    _check(m.global_every == 0 or m.sliding_window > 0, "model.global_every", m.global_every,
           "a layer pattern needs model.sliding_window > 0")
    _check(m.rope_local_theta == 0 or m.global_every > 0, "model.rope_local_theta",
           m.rope_local_theta, "only sliding layers of a pattern (model.global_every > 0) use it")
    for n in ("rope_factor", "rope_low_freq_factor", "rope_beta_fast", "rope_beta_slow"):
        _check(getattr(m, n) > 0, f"model.{n}", getattr(m, n), "must be > 0")
    _check(m.rope_high_freq_factor > m.rope_low_freq_factor, "model.rope_high_freq_factor",
           m.rope_high_freq_factor, f"must be > model.rope_low_freq_factor={m.rope_low_freq_factor}")
    if m.rope_type in ("llama3", "yarn"):
        _check(m.rope_original_max_len > 0, "model.rope_original_max_len", m.rope_original_max_len,
               f"rope_type {m.rope_type} needs the original context length (> 0)")


def validate(cfg: Config, n_devices: int | None = None) -> None:
    """Range and cross-field checks; with `n_devices`, also the mesh and batch divisibility."""
    for section in _SECTIONS:
        sub = getattr(cfg, section)
        for f in dataclasses.fields(sub):
            key, v = f"{section}.{f.name}", getattr(sub, f.name)
            # types again: catches a Config(...) built by hand
            _coerce(key, v, typing.get_type_hints(type(sub))[f.name])
            if key in _CHOICES:
                _check(v in _CHOICES[key], key, v, f"allowed: {', '.join(_CHOICES[key])}")
    _check(cfg.xla_gpu_flags in _CHOICES["xla_gpu_flags"], "xla_gpu_flags", cfg.xla_gpu_flags,
           f"allowed: {', '.join(_CHOICES['xla_gpu_flags'])}")
    m, mesh, opt, data, tr = cfg.model, cfg.mesh, cfg.optimizer, cfg.data, cfg.train
    positive = {"model": ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                          "max_seq_len", "rope_theta", "norm_eps"),
                "optimizer": ("lr", "eps"), "data": ("seq_len",),
                "train": ("steps", "global_batch", "microbatches", "log_every", "keep_checkpoints",
                          "max_inflight_steps", "max_nonfinite_steps")}
    for section, names in positive.items():
        for n in names:
            v = getattr(getattr(cfg, section), n)
            _check(v > 0, f"{section}.{n}", v, "must be > 0")
    for n in ("warmup_steps", "weight_decay"):
        _check(getattr(opt, n) >= 0, f"optimizer.{n}", getattr(opt, n), "must be >= 0")
    for n in ("eval_every", "eval_batches", "checkpoint_every", "sample_tokens"):
        _check(getattr(tr, n) >= 0, f"train.{n}", getattr(tr, n), "must be >= 0 (0 = off)")
    _check(0 <= opt.min_lr_ratio <= 1, "optimizer.min_lr_ratio", opt.min_lr_ratio,
           "must be in [0, 1]")
    for n in ("b1", "b2", "momentum"):
        _check(0 <= getattr(opt, n) < 1, f"optimizer.{n}", getattr(opt, n), "must be in [0, 1)")
    _check(opt.clip_norm is None or opt.clip_norm > 0, "optimizer.clip_norm", opt.clip_norm,
           "must be > 0, or null for no clipping")
    _check(m.kv_channels > 0 or m.d_model % m.n_heads == 0, "model.d_model", m.d_model,
           f"must be divisible by model.n_heads={m.n_heads} (or set model.kv_channels)")
    _check(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads,
           f"must divide model.n_heads={m.n_heads}")
    _check(m.kv_channels >= 0, "model.kv_channels", m.kv_channels, "must be >= 0 (0 = d_model/n_heads)")
    _check(m.head_dim % 2 == 0, "model.kv_channels" if m.kv_channels else "model.d_model",
           m.kv_channels or m.d_model, f"head dim {m.head_dim} must be even for RoPE")
    _check_decoder(m)
    _check(data.seq_len <= m.max_seq_len, "data.seq_len", data.seq_len,
           f"must be <= model.max_seq_len={m.max_seq_len}")
    _check(bool(data.path.strip()), "data.path", data.path, "must be a directory path")
    for key, v in (("data.seed", data.seed), ("train.seed", tr.seed)):
        _check(v >= 0, key, v, "must be >= 0")
    _check(bool(cfg.run_dir.strip()), "run_dir", cfg.run_dir,
           "must be a directory path (not empty: the run would write into the current directory)")
    sizes = (mesh.data, mesh.fsdp, mesh.tensor)
    for n, v in zip(("data", "fsdp", "tensor"), sizes):
        _check(v >= 1 or v == -1, f"mesh.{n}", v, "must be >= 1, or -1 for the remaining devices")
    _check(sizes.count(-1) <= 1, "mesh", dict(zip(("data", "fsdp", "tensor"), sizes)),
           "at most one of data, fsdp, tensor may be -1")
    _check(mesh.strategy.lower() in STRATEGIES or mesh.strategy.lower() in ALIASES, "mesh.strategy",
           mesh.strategy, f"allowed: {', '.join(STRATEGIES)} (aliases: {', '.join(ALIASES)})")
    _check(mesh.min_shard_size >= 0, "mesh.min_shard_size", mesh.min_shard_size, "must be >= 0")
    _check(0 <= mesh.max_replicated_fraction <= 1, "mesh.max_replicated_fraction",
           mesh.max_replicated_fraction, "must be in [0, 1]")
    _check(mesh.min_replicated_bytes >= 0, "mesh.min_replicated_bytes", mesh.min_replicated_bytes,
           "must be >= 0")
    _check(cfg.remat in REMAT_POLICIES, "remat", cfg.remat, f"allowed: {', '.join(REMAT_POLICIES)}")
    _check(cfg.offload in OFFLOADS, "offload", cfg.offload, f"allowed: {', '.join(OFFLOADS)}")
    dist = cfg.distributed
    _check(dist.num_processes is None or dist.num_processes >= 1, "distributed.num_processes",
           dist.num_processes, "must be >= 1 (or null to auto-detect)")
    _check(dist.process_id is None or 0 <= dist.process_id < (dist.num_processes or 1),
           "distributed.process_id", dist.process_id, "must be in [0, num_processes)")
    if dist.coordinator is not None:
        check_coordinator(dist.coordinator, "distributed.coordinator")
    _check(dist.init_timeout_s > 0, "distributed.init_timeout_s", dist.init_timeout_s, "must be > 0")
    try:
        Policy.parse(cfg.precision)
    except (ValueError, TypeError) as e:
        raise ConfigError("precision", f"{cfg.precision!r} is invalid; {e} "
                          "(e.g. params=float32,compute=bfloat16)") from None
    if tr.profile is not None:
        _, last = parse_profile(tr.profile)
        _check(last <= tr.steps, "train.profile", tr.profile, f"END must be <= train.steps={tr.steps}")
    if cfg.logging.wandb and importlib.util.find_spec("wandb") is None:
        raise ConfigError("logging.wandb", "true, but the wandb package is not installed; "
                          "pip install wandb, or set logging.wandb=false")
    _check(tr.global_batch % tr.microbatches == 0, "train.global_batch", tr.global_batch,
           f"must be divisible by train.microbatches={tr.microbatches}")
    if tr.tensorboard:
        from fsdp_jax.app.extras import available, missing_message
        _check(available("tensorboardX"), "train.tensorboard", tr.tensorboard,
               missing_message("tensorboardX", "train.tensorboard=true") + ", or set it to false")
    if n_devices is None:
        return
    try:
        data_n, fsdp_n, _ = resolve_mesh_shape(sizes, n_devices)
    except MeshError as e:
        raise ConfigError("mesh", str(e)) from None
    micro = tr.global_batch // tr.microbatches
    _check(micro % (data_n * fsdp_n) == 0, "train.global_batch", tr.global_batch,
           f"global_batch / microbatches = {micro} must be divisible by the batch-sharding "
           f"devices data*fsdp = {data_n}*{fsdp_n} = {data_n * fsdp_n} on {n_devices} devices")


def parse_profile(text: str) -> tuple[int, int]:
    """`train.profile` "START:END" -> (START, END): steps, 1-based, 1 <= START <= END."""
    head, sep, tail = str(text).partition(":")
    try:
        first, last = int(head), int(tail)
    except ValueError:
        first = last = 0
    _check(bool(sep) and 1 <= first <= last, "train.profile", text,
           "must be START:END, steps with 1 <= START <= END (e.g. 2:4)")
    return first, last


def check_coordinator(address: str, key: str) -> None:
    """`address` is host:port with a port in 1..65535 (IPv6 as [addr]:port)."""
    host, sep, port = address.rpartition(":")
    _check(bool(sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536), key, address,
           "must be HOST:PORT with a port in 1..65535, e.g. 127.0.0.1:1234")


def check_backend(cfg: Config, backend: str) -> None:
    """Settings that need a particular JAX backend ("cpu", "gpu", "tpu")."""
    _check(cfg.model.attention != "cudnn" or backend == "gpu", "model.attention", cfg.model.attention,
           f"needs a CUDA GPU (cuDNN); this run's JAX backend is {backend}: use model.attention=xla")


def check_data(cfg: Config) -> None:
    """The corpus at data.path exists (train.bin) and its vocabulary fits model.vocab_size."""
    path = Path(cfg.data.path)
    if not (path / "train.bin").is_file():
        how = ("run scripts/prepare_data.py --out DIR, or set data.source=stdlib"
               if cfg.data.source == "none" else "prepare it with scripts/prepare_data.py")
        raise ConfigError("data.path", f"{str(path)!r}: train.bin not found; {how}")
    meta = path / "meta.json"
    if meta.is_file():
        try:
            m = json.loads(meta.read_text())
            vocab = int(m["vocab_size"])
        except (ValueError, KeyError, TypeError):
            raise ConfigError("data.path", f"{str(meta)!r} is not a valid meta.json") from None
        tok = m.get("tokenizer")
        by = f" (tokenizer {tok})" if tok not in (None, "bytes", "external") else ""
        if m.get("format") == "packed":  # fine-tuning rows (fsdp_jax.app.sft_data): fixed length
            _check(cfg.data.seq_len == m.get("row_len"), "data.seq_len", cfg.data.seq_len,
                   f"must equal the packed corpus' row length {m.get('row_len')} in {meta}")
        elif cfg.data.document_mask:
            _check(isinstance(m.get("eos_id"), int) and m["eos_id"] >= 0, "data.document_mask", True,
                   f"needs a corpus with an EOS token ending each document; {meta} has none "
                   "(prepare it with --tokenizer)")
        _check(vocab <= cfg.model.vocab_size, "model.vocab_size", cfg.model.vocab_size,
               f"must be >= the corpus vocab_size {vocab} in {meta}{by}")
