"""Readers of config.json keys that several families' modules share."""

from __future__ import annotations

from collections.abc import Mapping


def int_key(raw: Mapping, key: str, bad, low: int = 1) -> int:
    """raw[key] as an integer >= `low`, else bad(key, ...)."""
    v = raw.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise bad(key, f"expected an integer >= {low}")
    return v
