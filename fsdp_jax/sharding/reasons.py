"""Why a leaf shards as it does: the reasons as data (`Why`, `Note`) and their prose.

`fsdp_jax.sharding.rules.decide_leaf` returns a spec and a tuple of `Note`s; nothing there
writes text. `format_note` / `format_notes` turn notes into the one-line reasons
`explain` shows, so the wording can change without touching a decision, and tests
assert notes, not prose.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Callable, Sequence


class Why(str, enum.Enum):
    """The kinds of reason one leaf's spec has (`Note.kind`)."""

    SCALAR = "scalar"  # 0-d leaf: replicated
    LOGICAL = "logical"  # mapped: ((name, axes), ...) of the dims that got an axis
    UNNAMED_TRAILING = "unnamed_trailing"  # dims: trailing dims without a logical name: unsharded
    UNKNOWN_NAMES = "unknown_names"  # names: not in the rules table: no axis
    NOT_DIVISIBLE = "not_divisible"  # name, axes, dim, size, n: rule axis does not divide
    NO_SHARD_AXIS = "no_shard_axis"  # unannotated, and no shard axis of size > 1
    THRESHOLD = "threshold"  # size, limit: below min_shard_size: replicated
    FALLBACK = "fallback"  # dim, size, axes, n: largest divisible dim
    UNSHARDABLE = "unshardable"  # axes, n: nothing divides the shard group


@dataclasses.dataclass(frozen=True)
class Note:
    """One structured reason; which fields are set depends on `kind` (see `Why`)."""

    kind: Why
    names: tuple[str, ...] = ()
    mapped: tuple[tuple[str, tuple[str, ...]], ...] = ()
    axes: tuple[str, ...] = ()
    dims: tuple[int, ...] = ()
    dim: int | None = None
    size: int | None = None
    n: int | None = None
    limit: int | None = None


def _axes(note: Note) -> str:
    return "x".join(note.axes)


# The prose of each kind of reason, as data (wording may change; tests assert Notes).
PROSE: dict[Why, Callable[[Note], str]] = {
    Why.SCALAR: lambda n: "scalar: replicated",
    Why.LOGICAL: lambda n: (
        "logical: " + (", ".join(f"{name}->{'x'.join(a)}" for name, a in n.mapped) or "no dim maps to a mesh axis")
    ),
    Why.UNNAMED_TRAILING: lambda n: f"no logical name for dim(s) {', '.join(map(str, n.dims))}: unsharded",
    Why.UNKNOWN_NAMES: lambda n: f"names not in the rules table: {', '.join(n.names)}",
    Why.NOT_DIVISIBLE: lambda n: (
        f"{', '.join(n.names)}->{_axes(n)} does not divide dim {n.dim} (size {n.size}) by {n.n}"
    ),
    Why.NO_SHARD_AXIS: lambda n: "fallback: no shard axis of size > 1: replicated",
    Why.THRESHOLD: lambda n: f"threshold: {n.size} elements < min_shard_size {n.limit}: replicated",
    Why.FALLBACK: lambda n: f"fallback: dim {n.dim} (size {n.size}) over {_axes(n)}={n.n}",
    Why.UNSHARDABLE: lambda n: f"unshardable: no dim divisible by {_axes(n) or 'the group'}={n.n}",
}


def format_note(note: Note) -> str:
    """One reason as one clause of prose."""
    return PROSE[note.kind](note)


def format_notes(notes: Sequence[Note]) -> str:
    return "; ".join(format_note(n) for n in notes)
