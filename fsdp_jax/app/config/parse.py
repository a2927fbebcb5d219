"""Reading a run config: YAML (safe_load only) and `key=value` overrides -> a `Config`.

    cfg = load_config("configs/tiny.yaml", ["train.steps=20", "mesh.strategy=no_shard"])

Unknown keys are a ConfigError with a did-you-mean; values are checked against the
field types of `fsdp_jax.app.config.schema` and then validated (`config_checks.validate`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fsdp_jax.app.config.checks import validate
from fsdp_jax.app.config.schema import NAME_LISTS, SECTIONS, Config, all_keys, coerce, field_type
from fsdp_jax.errors import ConfigError

_OVERRIDE_ALIASES = {"strategy": "mesh.strategy", "steps": "train.steps", "lr": "optimizer.lr"}


def _unknown(key: str, candidates: Sequence[str], shown: Sequence[str] | None = None) -> ConfigError:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"allowed: {', '.join(shown or candidates)}"
    return ConfigError(key, f"unknown key; {hint}")


def _build(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(prefix, f"expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in raw:
        if k not in hints:
            raise _unknown(f"{prefix}.{k}", [f"{prefix}.{n}" for n in names])
    return cls(**{k: coerce(f"{prefix}.{k}", v, hints[k]) for k, v in raw.items()})


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
            holder[keys[-1]] = prefix + os.path.expanduser(v[len(prefix) :])
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
        if k in SECTIONS:
            kwargs[k] = _build(hints[k], {} if v is None else v, k)
        else:
            kwargs[k] = coerce(k, v, hints[k])
    cfg = Config(**kwargs)
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


def apply_overrides(raw: Mapping, overrides: Sequence[str]) -> dict:
    """Return a copy of the raw config dict with `key=value` overrides applied."""
    out = {k: dict(v) if isinstance(v, Mapping) else v for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = _OVERRIDE_ALIASES.get(key.strip(), key.strip())
        if not sep or not key:
            raise ConfigError("override", f"{item!r} is not key=value (e.g. train.steps=20)")
        if key in SECTIONS:
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
            mesh_["rules"] = {**rules_, key[len("mesh.rules.") :]: value}
            continue
        tp = field_type(key)
        if tp is None:
            head = key.partition(".")[0]
            shown = (
                [f"{head}.{f.name}" for f in dataclasses.fields(SECTIONS[head])]
                if head in SECTIONS
                else [f"{k}.KEY" if k in SECTIONS else k for k in typing.get_type_hints(Config)]
            )
            raise _unknown(key, all_keys(), shown)
        if key in NAME_LISTS and text.strip().startswith("["):  # lora.targets=[q_proj,v_proj]: a YAML list
            try:
                value = yaml.safe_load(text)
            except yaml.YAMLError:
                raise ConfigError(key, f"cannot parse value {text!r}") from None
        elif tp in (str, str | None):  # keep strings verbatim: 'a: b' or '1,2' must not become YAML
            value = None if tp is not str and text.strip() in ("null", "~", "None", "") else text
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


def load_config(path: str | Path, overrides: Sequence[str] = (), fill: Callable[[dict], dict] | None = None) -> Config:
    """Read a YAML config, apply `key=value` overrides, build and validate (no device checks).
    `fill` completes the raw sections before they are built (the trainer passes the Hugging
    Face reader that fills `model` from `init_from=hf:PATH`: `fsdp_jax.app.trainer.setup.load_run_config`)."""
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
        raise ConfigError(
            str(path), f"not a UTF-8 text file (byte {e.start}: {e.object[e.start : e.start + 1]!r})"
        ) from None
    except yaml.YAMLError as e:
        where = getattr(e, "problem_mark", None)
        at = f" at line {where.line + 1}" if where else ""
        raise ConfigError(
            str(path), f"YAML syntax error{at}: {getattr(e, 'problem', None) or 'invalid YAML'}"
        ) from None
    raw = {} if raw is None else raw
    if not isinstance(raw, Mapping):
        raise ConfigError(str(path), f"top level must be a mapping of sections, got {type(raw).__name__}")
    raw = expand_user_paths(apply_overrides(raw, overrides))
    return config_from_dict(fill(raw) if fill is not None else raw)
