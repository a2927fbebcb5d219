"""Reading a run config: YAML (safe_load only) and `key=value` overrides -> a validated `Config`.

    cfg = load_config("configs/tiny.yaml", ["train.steps=20", "mesh.strategy=no_shard"])

The file, the overrides and each field are read by `fsdp_jax.app.config.read` (no JAX); the
checks across fields follow (`checks.validate`), then YAML out (`save_config`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import yaml

from fsdp_jax.app.config.checks import validate
from fsdp_jax.app.config.read import apply_overrides, build_config, expand_user_paths, read_yaml
from fsdp_jax.app.config.schema import Config


def config_from_dict(d: Mapping) -> Config:
    """Build a Config from plain nested mappings (missing keys take defaults) and validate it."""
    cfg = build_config(d)
    validate(cfg)
    return cfg


def config_to_dict(cfg: Config) -> dict:
    """Plain nested dict (yaml.safe_dump-able; tuples as lists, as YAML reads them back);
    config_from_dict(config_to_dict(c)) == c. `model.family` appears only when set."""
    return {k: model_dict(cfg.model) if k == "model" else _lists(v) for k, v in dataclasses.asdict(cfg).items()}


def model_dict(model) -> dict:
    """The model section as a plain dict; `family` only when a family's own parts build it
    (so configs of every other model read and write as they did)."""
    return {k: _lists(v) for k, v in dataclasses.asdict(model).items() if k != "family" or v}


def _lists(v):
    if isinstance(v, dict):
        return {k: _lists(x) for k, x in v.items()}
    return [_lists(x) for x in v] if isinstance(v, tuple) else v


def save_config(cfg: Config, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def load_config(path: str | Path, overrides: Sequence[str] = (), fill: Callable[[dict], dict] | None = None) -> Config:
    """Read a YAML config, apply `key=value` overrides, build and validate (no device checks).
    `fill` completes the raw sections before they are built (the trainer passes the Hugging
    Face reader that fills `model` from `init_from=hf:PATH`: `fsdp_jax.app.trainer.setup.load_run_config`)."""
    raw = read_yaml(path)
    raw = expand_user_paths(apply_overrides(raw, overrides))
    return config_from_dict(fill(raw) if fill is not None else raw)
