"""Reading a run config without JAX: YAML (safe_load only) and `key=value` overrides -> a
`Config` checked field by field (types, limits, choices; `schema.check_fields`).

    cfg = read_config("configs/tiny.yaml", ["train.steps=20"])   # the CLI's pre-run check

Unknown keys are a ConfigError with a did-you-mean. The checks across fields, which read the
library's tables, are `fsdp_jax.app.config.checks` (`parse.load_config` runs both): a command
refuses a missing file, bad YAML, a bad override, an unknown key or a bad value here, before
JAX loads (`fsdp_jax.app.cli.args.config_before_jax`).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import yaml

from fsdp_jax.app.config.schema import NAME_LISTS, SECTIONS, Config, all_keys, check_fields, coerce, field_type
from fsdp_jax.errors import ConfigError

_OVERRIDE_ALIASES = {"strategy": "mesh.strategy", "steps": "train.steps", "lr": "optimizer.lr"}


def unknown_key(key: str, candidates: Sequence[str], shown: Sequence[str] | None = None) -> ConfigError:
    close = difflib.get_close_matches(key, list(candidates), n=1, cutoff=0.6)
    hint = f"did you mean {close[0]}?" if close else f"allowed: {', '.join(shown or candidates)}"
    return ConfigError(key, f"unknown key; {hint}")


def build_section(cls: type, raw: Any, prefix: str) -> Any:
    if not isinstance(raw, Mapping):
        raise ConfigError(prefix, f"expected a mapping of keys, got {raw!r}")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for k in raw:
        if k not in hints:
            raise unknown_key(f"{prefix}.{k}", [f"{prefix}.{n}" for n in names])
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
            raise unknown_key(key, all_keys(), shown)
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


def read_yaml(path: str | Path) -> dict:
    """The config file's top-level mapping ({} for an empty file); ConfigError naming the file
    when it is missing, not a regular file, unreadable, not UTF-8, not YAML or not a mapping."""
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
    return dict(raw)


def build_config(d: Mapping) -> Config:
    """A Config from plain nested mappings (missing keys take defaults): unknown keys and
    each value's type; no limits or checks across fields (`parse.config_from_dict` adds them)."""
    if not isinstance(d, Mapping):
        raise ConfigError("config", f"expected a mapping at the top level, got {type(d).__name__}")
    d = expand_user_paths(d)
    hints = typing.get_type_hints(Config)
    kwargs = {}
    for k, v in d.items():
        if k not in hints:
            raise unknown_key(str(k), list(hints))
        if k in SECTIONS:
            kwargs[k] = build_section(hints[k], {} if v is None else v, k)
        else:
            kwargs[k] = coerce(k, v, hints[k])
    return Config(**kwargs)


def read_config(path: str | Path, overrides: Sequence[str] = ()) -> Config | None:
    """`parse.load_config`'s refusals that need no JAX, in its order: the file, its YAML, the
    overrides, unknown keys, each value's type, limits and choices. Returns the Config so far,
    or None when `init_from` is `hf:PATH` (the model section is filled from that checkpoint
    first: `fsdp_jax.app.trainer.setup.load_run_config`, after JAX)."""
    raw = expand_user_paths(apply_overrides(read_yaml(path), overrides))
    if isinstance(raw.get("init_from"), str) and raw["init_from"].startswith("hf:"):
        return None
    cfg = build_config(raw)
    check_fields(cfg)
    return cfg
