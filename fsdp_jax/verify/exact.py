"""Leaves `fsdp_jax.verify.run` compares exactly (its `exact` option): params a rule moves in
discrete steps rather than by a gradient, where any difference from the one-device run is a
different decision, not rounding. DeepSeek-V3's score-correction bias is the case: the train
step's `post_update` moves it by +-u from the step's expert loads (app/trainer/expert_bias.py),
so under every strategy it must equal the reference's bit for bit until a routing flip (a
token's near-tied top-k choice), after which verify reports and does not judge anyway.
"""

from __future__ import annotations

import numpy as np

from fsdp_jax.errors import VerifyError


def exact_indices(paths: list[str], name: str | None) -> list[int]:
    """The flat indices of the leaves whose last path component is `name` (none for None);
    VerifyError when `name` names no leaf."""
    if name is None:
        return []
    if not isinstance(name, str) or not name:
        raise VerifyError(f"verify: exact={name!r} must be a leaf name (the last component of a param's path)")
    found = [i for i, p in enumerate(paths) if p.rsplit("/", 1)[-1] == name]
    if not found:
        raise VerifyError(f"verify: exact={name!r} names no param leaf")
    return found


def max_abs_at(leaves: list[np.ndarray], ref: list[np.ndarray], idx: list[int]) -> float:
    """max |leaves[i] - ref[i]| over the indices `idx` (0.0 for none)."""
    return max((float(np.max(np.abs(leaves[i] - ref[i]), initial=0.0)) for i in idx), default=0.0)


def unequal(paths: list[str], leaves: list[np.ndarray], ref: list[np.ndarray], idx: list[int]):
    """(path, max abs difference) of every exact leaf that differs from the reference's, worst first."""
    out = [(paths[i], float(np.max(np.abs(leaves[i] - ref[i]), initial=0.0))) for i in idx]
    return tuple(sorted(((p, d) for p, d in out if d != 0.0), key=lambda pd: -pd[1]))
