"""Config field helpers: the limits a field can carry (`LIMITS`), `limit` and `names`."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

# Limits a field can carry: (test, what the error says is allowed).
LIMITS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "> 0": (lambda v: v > 0, "must be > 0"),
    ">= 0": (lambda v: v >= 0, "must be >= 0"),
    "off": (lambda v: v >= 0, "must be >= 0 (0 = off)"),
    "[0, 1]": (lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    "[0, 1)": (lambda v: 0 <= v < 1, "must be in [0, 1)"),
    "[0, 0.5)": (lambda v: 0 <= v < 0.5, "must be in [0, 0.5)"),
    "> 0 or null": (lambda v: v is None or v > 0, "must be > 0, or null for no clipping"),
    ">= 1 or null": (lambda v: v is None or v >= 1, "must be >= 1 (or null to auto-detect)"),
    "mesh size": (lambda v: v >= 1 or v == -1, "must be >= 1, or -1 for the remaining devices"),
    ">= 2": (lambda v: v >= 2, "must be >= 2"),
    "(0, 1]": (lambda v: 0 < v <= 1, "must be in (0, 1]"),
    "peer timeout": (lambda v: 0 <= v <= 86400, "must be in [0, 86400] seconds (0 = no peer watch)"),
}


def names(default: str):
    """A str field that takes several names: a string (spaces or commas between them) or a
    YAML list of strings, kept as one space-separated string (`NAME_LISTS`)."""
    return dataclasses.field(default=default, metadata={"names": True})


def limit(default: Any, kind: str | None = None, *, choices: tuple[str, ...] | None = None):
    """A dataclass field with `default` and its limit: a key of LIMITS and/or `choices`."""
    assert kind is None or kind in LIMITS, kind
    return dataclasses.field(default=default, metadata={"limit": kind, "choices": choices})
