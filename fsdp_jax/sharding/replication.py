"""How much of the params stays replicated over the shard axes: `summarize` a plan's
rows (`Summary`), `format_summary`, and the guard `check_sufficiently_sharded` with its
limits. `fsdp_jax.sharding.rules` re-exports these names.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Sequence

from jax.sharding import Mesh

from fsdp_jax.errors import ReplicatedWarning, ShardingError
from fsdp_jax.sharding.leaf_sharding import LeafSharding, as_tuple
from fsdp_jax.sharding.thresholds import DEFAULT_MAX_REPLICATED_FRACTION, DEFAULT_MIN_REPLICATED_BYTES


@dataclasses.dataclass(frozen=True)
class Summary:
    """Totals over a plan's rows: `bytes_per_device` and `total_bytes` of all
    params, `replicated_bytes` (total bytes of leaves sharded over no shard axis),
    `replicated_fraction` of total bytes, and the shard group's axes."""

    bytes_per_device: int
    total_bytes: int
    replicated_bytes: int
    replicated_fraction: float
    group: tuple[str, ...]


def summarize(rows: Sequence[LeafSharding], shard_axes: Sequence[str], mesh: Mesh) -> Summary:
    group = tuple(a for a in shard_axes if mesh.shape.get(a, 1) > 1)
    total = sum(r.total_bytes for r in rows)
    rep = sum(r.total_bytes for r in rows if not any(a in as_tuple(e) for e in r.spec for a in group)) if group else 0
    return Summary(sum(r.bytes_per_device for r in rows), total, rep, rep / (total or 1), group)


def format_summary(s: Summary) -> str:
    over = "x".join(s.group) or "no shard axis"
    return (
        f"total: {s.bytes_per_device:,} B/device of {s.total_bytes:,} B of params; "
        f"replicated over {over}: {s.replicated_fraction:.1%} ({s.replicated_bytes:,} B)"
    )


def check_sufficiently_sharded(
    rows: Sequence[LeafSharding],
    shard_axes: Sequence[str],
    mesh: Mesh,
    max_replicated_fraction: float = DEFAULT_MAX_REPLICATED_FRACTION,
    min_replicated_bytes: int = DEFAULT_MIN_REPLICATED_BYTES,
) -> float:
    """Fail when more than `max_replicated_fraction` of parameter bytes are not
    sharded over any of `shard_axes`, unless those replicated bytes are under
    `min_replicated_bytes` (then warn: a small model loses nothing by replicating).
    Returns the replicated fraction."""
    s = summarize(rows, shard_axes, mesh)
    if not s.group or s.replicated_fraction <= max_replicated_fraction:
        return s.replicated_fraction
    group = s.group
    bad = [r for r in rows if not any(a in as_tuple(e) for e in r.spec for a in group)]
    worst = sorted(bad, key=lambda r: -r.total_bytes)[:5]
    listing = ", ".join(f"{r.path} {r.shape} ({r.reason})" for r in worst)
    msg = (
        f"{s.replicated_fraction:.1%} of parameter bytes are replicated over {'x'.join(group)} "
        f"(allowed {max_replicated_fraction:.0%}); largest: {listing}. Fix: annotate "
        "these leaves with logical names that map to fsdp, or lower min_shard_size"
    )
    if s.replicated_bytes < min_replicated_bytes:
        warnings.warn(
            f"{msg} (not an error: {s.replicated_bytes:,} replicated bytes are under "
            f"min_replicated_bytes {min_replicated_bytes:,})",
            ReplicatedWarning,
            stacklevel=2,
        )
        return s.replicated_fraction
    raise ShardingError(msg)
