"""One leaf's sharding decision as data: `LeafSharding` (path, shape, dtype, spec, bytes
per device and the structured reasons), and how a spec, a tree path and a mesh-axes
entry are spelled. `fsdp_jax.sharding.rules` makes these rows (`explain`) and re-exports the names.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from fsdp_jax.sharding.axes import MeshAxes
from fsdp_jax.sharding.reasons import Note, Why, format_notes


@dataclasses.dataclass(frozen=True)
class LeafSharding:
    """How one leaf shards (`spec`) and why (`notes`, structured; `reason` is the
    same as one line of prose, `format_notes(notes)`)."""

    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: P
    bytes_per_device: int
    total_bytes: int
    notes: tuple[Note, ...] = ()

    @property
    def reason(self) -> str:
        return format_notes(self.notes)

    @property
    def kinds(self) -> tuple[Why, ...]:
        return tuple(n.kind for n in self.notes)

    @property
    def replicated(self) -> bool:
        return all(e is None for e in self.spec)

    def as_dict(self) -> dict[str, Any]:
        return {
            "path": self.path,
            "shape": list(self.shape),
            "dtype": self.dtype,
            "spec": spec_str(self.spec),
            "bytes_per_device": self.bytes_per_device,
            "total_bytes": self.total_bytes,
            "reason": self.reason,
        }


def spec_str(spec: P) -> str:
    def one(e):
        if e is None:
            return "None"
        if isinstance(e, tuple):
            return "(" + ",".join(e) + ")"
        return e

    return "P(" + ", ".join(one(e) for e in spec) + ")"


def path_str(path) -> str:
    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


def as_tuple(m: MeshAxes) -> tuple[str, ...]:
    if m is None:
        return ()
    return (m,) if isinstance(m, str) else tuple(m)
