"""How each leaf shards: a logical-axis rules table plus a fallback rule.

Two ways to say how a leaf shards, both resolved here:

* **logical dims**: the leaf carries names such as ``("embed", "mlp")`` (Flax
  ``with_partitioning`` / ``with_logical_partitioning`` metadata, or a tree of
  name tuples you pass). A small table maps names to mesh axes; FSDP is the row
  ``embed -> fsdp``. A mesh axis is used at most once per leaf: the first dim that
  claims it wins (so ``batch -> (data, fsdp)`` on an activation leaves its
  ``embed`` dim unsharded).
* **fallback** for unannotated leaves (plain pytrees): shard the largest dim
  divisible by the shard-group size; leaves under ``min_shard_size`` elements
  (biases, norm scales) stay replicated.

Strategies (``fsdp_jax.strategy``) decide which mesh axes form the shard group by
passing ``shard_axes``: every ``fsdp`` produced by a rule is replaced by them.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import numpy as np
from jax.sharding import Mesh, PartitionSpec as P

from fsdp_jax import axes as ax

MeshAxes = str | tuple[str, ...] | None
Rules = Mapping[str, MeshAxes]

DEFAULT_RULES: Rules = {
    # activations
    ax.BATCH: (ax.DATA, ax.FSDP),
    ax.LENGTH: None,
    # parameters
    ax.EMBED: ax.FSDP,
    ax.MLP: ax.TENSOR,
    ax.HEADS: ax.TENSOR,
    ax.KV_HEADS: ax.TENSOR,
    ax.KV: None,
    ax.VOCAB: ax.TENSOR,
    ax.LAYERS: None,
    ax.NORM: None,
}
DEFAULT_MIN_SHARD_SIZE = 2**14  # elements; smaller unannotated leaves stay replicated
DEFAULT_MAX_REPLICATED_FRACTION = 0.02


class ShardingError(ValueError):
    """A leaf or tree that cannot be sharded as asked; the message names the fix."""


@dataclasses.dataclass(frozen=True)
class LeafSharding:
    """How one leaf shards, and why (one row of `explain`)."""
    path: str
    shape: tuple[int, ...]
    dtype: str
    spec: P
    bytes_per_device: int
    total_bytes: int
    reason: str

    @property
    def replicated(self) -> bool:
        return all(e is None for e in self.spec)

    def as_dict(self) -> dict[str, Any]:
        return {"path": self.path, "shape": list(self.shape), "dtype": self.dtype,
                "spec": spec_str(self.spec), "bytes_per_device": self.bytes_per_device,
                "total_bytes": self.total_bytes, "reason": self.reason}


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


def _as_tuple(m: MeshAxes) -> tuple[str, ...]:
    if m is None:
        return ()
    return (m,) if isinstance(m, str) else tuple(m)


def _entry(axes_: Sequence[str]):
    axes_ = tuple(axes_)
    if not axes_:
        return None
    return axes_[0] if len(axes_) == 1 else axes_


def axis_size(mesh: Mesh, axes_: MeshAxes) -> int:
    return math.prod(mesh.shape.get(a, 1) for a in _as_tuple(axes_))


def logical_to_spec(names: Sequence[str | None], rules: Rules | None = None,
                    shard_axes: Sequence[str] = (ax.FSDP,)) -> P:
    """PartitionSpec for logical dim `names` under `rules`.

    Unknown names and None map to no axis. Each mesh axis is used once: the first
    dim claiming it wins. Every `fsdp` a rule produces becomes `shard_axes`.
    """
    rules = DEFAULT_RULES if rules is None else rules
    used: set[str] = set()
    out = []
    for name in names:
        mapped: list[str] = []
        for a in _as_tuple(rules.get(name) if name is not None else None):
            for b in (tuple(shard_axes) if a == ax.FSDP else (a,)):
                if b not in used:
                    mapped.append(b)
        used.update(mapped)
        out.append(_entry(mapped))
    return P(*out)


def flax_rules(rules: Rules | None = None) -> tuple[tuple[str, MeshAxes], ...]:
    """The table in the `(name, mesh_axes)` pair form of `flax.linen.logical_axis_rules`."""
    rules = DEFAULT_RULES if rules is None else rules
    return tuple((k, v) for k, v in rules.items())


def _bytes_per_device(shape, dtype, spec: P, mesh: Mesh) -> tuple[int, int]:
    itemsize = np.dtype(dtype).itemsize
    total = math.prod(shape) * itemsize
    per_dev = math.prod(-(-d // axis_size(mesh, e)) for d, e in zip(shape, spec)) * itemsize
    return per_dev, total


def _fallback_dim(shape, n: int) -> int | None:
    """The largest dim divisible by `n` (the first on ties), or None."""
    for i in sorted(range(len(shape)), key=lambda i: (-shape[i], i)):
        if shape[i] % n == 0:
            return i
    return None


def plan_leaf(path: str, shape: Sequence[int], dtype, names: Sequence[str | None] | None,
              mesh: Mesh, rules: Rules | None = None,
              shard_axes: Sequence[str] = (ax.FSDP,),
              min_shard_size: int = DEFAULT_MIN_SHARD_SIZE) -> tuple[LeafSharding, str | None]:
    """Resolve one leaf to a spec and a reason.

    Returns (row, problem): problem is a message when the leaf is at least
    `min_shard_size` elements, should shard, yet no dim divides the shard group.
    """
    shape = tuple(int(d) for d in shape)
    rules = DEFAULT_RULES if rules is None else rules
    group = tuple(a for a in shard_axes if mesh.shape.get(a, 1) > 1)
    group_n = math.prod(mesh.shape[a] for a in group)
    size = math.prod(shape)

    def done(entries, reason, problem=None):
        spec = P(*entries)
        per_dev, total = _bytes_per_device(shape, dtype, spec, mesh)
        row = LeafSharding(path, shape, np.dtype(dtype).name, spec, per_dev, total, reason)
        return row, problem

    if not shape:
        return done((), "scalar: replicated")
    if names is not None and len(names) != len(shape):
        raise ShardingError(f"{path}: logical names {tuple(names)} have {len(names)} entries "
                            f"but the shape {shape} has {len(shape)} dims")

    entries: list = [None] * len(shape)
    notes: list[str] = []
    unknown: list[str] = []
    if names is not None:
        for i, (d, e) in enumerate(zip(shape, logical_to_spec(names, rules, shard_axes))):
            kept = [a for a in _as_tuple(e) if mesh.shape.get(a, 1) > 1]  # size-1 axes add nothing
            while kept and d % math.prod(mesh.shape[a] for a in kept):
                kept.pop()  # drop the innermost axis until the dim divides
            if d % axis_size(mesh, e):
                notes.append(f"{names[i]}->{'x'.join(_as_tuple(e))} does not divide dim {i} "
                             f"(size {d}) by {axis_size(mesh, e)}")
            entries[i] = _entry(kept)
        unknown = [n for n in names if n is not None and n not in rules]
        mapped = [f"{n}->{'x'.join(_as_tuple(e))}" for n, e in zip(names, entries) if e is not None]
        parts = ["logical: " + (", ".join(mapped) if mapped else "no dim maps to a mesh axis")]
        if unknown:
            parts.append(f"names not in the rules table: {', '.join(unknown)}")
        parts += notes
    else:
        parts = []

    used = {a for e in entries for a in _as_tuple(e)}
    on_group = any(a in used for a in group)
    needs_fallback = names is None or bool(notes) or bool(unknown)
    if group_n == 1 or on_group or not needs_fallback:
        if names is None:
            parts.append("fallback: no shard axis of size > 1: replicated")
        return done(entries, "; ".join(parts))
    if size < min_shard_size:
        parts.append(f"threshold: {size} elements < min_shard_size {min_shard_size}: replicated")
        return done(entries, "; ".join(parts))
    free = tuple(a for a in group if a not in used)
    n = math.prod(mesh.shape[a] for a in free)
    dim = _fallback_dim([d if entries[i] is None else 0 for i, d in enumerate(shape)], n) if n > 1 else None
    if dim is None or entries[dim] is not None:
        parts.append(f"unshardable: no dim divisible by {'x'.join(free) or 'the group'}={n}")
        problem = (f"{path}: shape {shape} ({size} elements) has no dim divisible by the "
                   f"shard group {'x'.join(group)}={group_n}")
        return done(entries, "; ".join(parts), problem)
    entries[dim] = _entry(free)
    parts.append(f"fallback: dim {dim} (size {shape[dim]}) over {'x'.join(free)}={n}")
    return done(entries, "; ".join(parts))


def explain(params, mesh: Mesh, logical_axes=None, rules: Rules | None = None,
            shard_axes: Sequence[str] = (ax.FSDP,),
            min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
            allow_unshardable: bool = False) -> list[LeafSharding]:
    """Per leaf of `params` (arrays or ShapeDtypeStructs): path, shape, dtype, spec,
    bytes per device and why.

    `logical_axes` is None (every leaf unannotated) or a tree matching `params`
    whose leaves are tuples of logical names (None for an unannotated leaf).
    Raises ShardingError listing every leaf that is too large to replicate but has
    no dim divisible by the shard group, unless `allow_unshardable`.
    """
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    if logical_axes is None:
        names = [None] * len(leaves)
    else:
        try:
            names = treedef.flatten_up_to(logical_axes)
        except (ValueError, TypeError) as e:
            raise ShardingError(f"logical_axes does not match the params tree: {e}") from None
    rows, problems = [], []
    for (path, leaf), nm in zip(leaves, names):
        if isinstance(nm, P):
            nm = tuple(nm) if len(nm) or not np.shape(leaf) else None
        row, problem = plan_leaf(path_str(path), np.shape(leaf), leaf.dtype, nm, mesh,
                                 rules, shard_axes, min_shard_size)
        rows.append(row)
        if problem:
            problems.append(problem)
    if problems and not allow_unshardable:
        raise ShardingError(
            f"{len(problems)} parameter(s) cannot shard: " + "; ".join(problems)
            + ". Fix: pad that dim to a multiple of the shard group, pick an fsdp size "
              "that divides it, or annotate the leaf with logical names")
    return rows


def specs_from_rows(params, rows: Sequence[LeafSharding]):
    """A tree of PartitionSpecs shaped like `params` from `explain` rows."""
    treedef = jax.tree.structure(params)
    return jax.tree.unflatten(treedef, [r.spec for r in rows])


def check_sufficiently_sharded(rows: Sequence[LeafSharding], shard_axes: Sequence[str],
                               mesh: Mesh,
                               max_replicated_fraction: float = DEFAULT_MAX_REPLICATED_FRACTION) -> float:
    """Fail when more than `max_replicated_fraction` of parameter bytes are not
    sharded over any of `shard_axes`. Returns the replicated fraction."""
    group = [a for a in shard_axes if mesh.shape.get(a, 1) > 1]
    if not group:
        return 0.0
    total = sum(r.total_bytes for r in rows) or 1
    bad = [r for r in rows if not any(a in _as_tuple(e) for e in r.spec for a in group)]
    frac = sum(r.total_bytes for r in bad) / total
    if frac > max_replicated_fraction:
        worst = sorted(bad, key=lambda r: -r.total_bytes)[:5]
        listing = ", ".join(f"{r.path} {r.shape} ({r.reason})" for r in worst)
        raise ShardingError(
            f"{frac:.1%} of parameter bytes are replicated over {'x'.join(group)} "
            f"(allowed {max_replicated_fraction:.0%}); largest: {listing}. Fix: annotate "
            "these leaves with logical names that map to fsdp, or lower min_shard_size")
    return frac


def logical_axes_of(tree):
    """Logical names carried as metadata: Flax NNX `State`s of Variables created with
    `nnx.with_partitioning`, or Linen variables boxed by `nn.with_logical_partitioning`.

    Returns (values, logical_axes): the plain value tree and a matching tree of
    name tuples (None where a leaf has no annotation), or (tree, None) when nothing
    carries metadata.
    """
    from flax import linen as nn
    from flax import nnx

    if isinstance(tree, nnx.State) or any(isinstance(x, nnx.Variable) for x in jax.tree.leaves(
            tree, is_leaf=lambda x: isinstance(x, nnx.Variable))):
        specs = nnx.get_partition_spec(tree)
        values = tree
    elif any(isinstance(x, nn.spmd.LogicallyPartitioned) for x in jax.tree.leaves(
            tree, is_leaf=lambda x: isinstance(x, nn.spmd.LogicallyPartitioned))):
        specs = nn.get_partition_spec(tree)
        values = nn.unbox(tree)
    else:
        return tree, None
    flat_vals, treedef = jax.tree.flatten(values)
    flat_specs = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    if len(flat_specs) != len(flat_vals):
        return values, None
    names = [tuple(s) if len(s) else (None if np.ndim(v) else ()) for s, v in zip(flat_specs, flat_vals)]
    return values, jax.tree.unflatten(treedef, names)
