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

Strategies (``fsdp_jax.sharding.strategy``) decide which mesh axes form the shard group by
passing ``shard_axes``: every ``fsdp`` produced by a rule is replaced by them.

A decision is a `LeafSharding` row (`fsdp_jax.sharding.leaf_sharding`); the guard against too
many replicated bytes over a plan's rows is `fsdp_jax.sharding.replication`. Both are
re-exported here.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from fsdp_jax.errors import ShardingError, UnknownNamesWarning
from fsdp_jax.sharding import axes
from fsdp_jax.sharding.axes import MeshAxes
from fsdp_jax.sharding.leaf_sharding import LeafSharding, as_tuple, path_str
from fsdp_jax.sharding.reasons import Note, Why
from fsdp_jax.sharding.rule_table import DEFAULT_RULES, Rules, rule_entry
from fsdp_jax.sharding.rule_table import merge_rules as merge_rules  # `fsdp_jax.rules.merge_rules` stays public
from fsdp_jax.sharding.thresholds import DEFAULT_MIN_SHARD_SIZE

# ----------------------------------------------------------------------------- decisions


def axis_size(mesh: Mesh, axes_: MeshAxes) -> int:
    return math.prod(mesh.shape.get(a, 1) for a in as_tuple(axes_))


# Logical dims whose rule names mesh axes as they are: the strategy's shard group does not
# replace their `fsdp`, and they claim their axes before any other dim of the leaf. Experts
# over `fsdp` (expert parallelism, as torchtitan / DeepSpeed borrow EP from the data-parallel
# group) then stay split over fsdp at rest and in compute (every strategy's spec keeps
# them there, so no gather collects them), and no other dim of an expert weight also
# shards over fsdp.
LITERAL_NAMES = frozenset({axes.EXPERT})


def logical_to_spec(
    names: Sequence[str | None], rules: Rules | None = None, shard_axes: Sequence[str] = (axes.FSDP,)
) -> P:
    """PartitionSpec for logical dim `names` under `rules`.

    Unknown names and None map to no axis. Each mesh axis is used once: the dims in
    `LITERAL_NAMES` (experts) claim theirs first, then the first dim claiming an axis
    wins. Every `fsdp` a rule produces becomes `shard_axes`, except for `LITERAL_NAMES`.
    """
    rules = DEFAULT_RULES if rules is None else rules
    used: set[str] = set()
    out: list = [None] * len(names)

    def claim(i: int, name: str | None, literal: bool) -> None:
        mapped: list[str] = []
        for a in as_tuple(rules.get(name) if name is not None else None):
            for b in (a,) if literal or a != axes.FSDP else tuple(shard_axes):
                if b not in used:
                    mapped.append(b)
        used.update(mapped)
        out[i] = rule_entry(mapped)

    for i, name in enumerate(names):
        if name in LITERAL_NAMES:
            claim(i, name, True)
    for i, name in enumerate(names):
        if name not in LITERAL_NAMES:
            claim(i, name, False)
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


def decide_leaf(
    shape: Sequence[int],
    names: Sequence[str | None] | None,
    mesh: Mesh,
    rules: Rules | None = None,
    shard_axes: Sequence[str] = (axes.FSDP,),
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
) -> tuple[P, tuple[Note, ...]]:
    """The spec of one leaf of `shape` and the structured reasons for it (no prose).

    `names`: logical dim names (None: unannotated, use the fallback rule). Fewer
    names than dims leave the trailing dims unsharded (as Flax and JAX do); more
    names than dims raise ShardingError. A `Why.UNSHARDABLE` note marks a leaf that
    is at least `min_shard_size` elements, should shard, yet has no dim divisible
    by the shard group.
    """
    shape = tuple(int(d) for d in shape)
    rules = DEFAULT_RULES if rules is None else rules
    group = tuple(a for a in shard_axes if mesh.shape.get(a, 1) > 1)
    group_n = math.prod(mesh.shape[a] for a in group)
    size = math.prod(shape)
    if not shape:
        return P(), (Note(Why.SCALAR),)
    if names is not None and len(names) > len(shape):
        raise ShardingError(
            f"logical names {tuple(names)} have {len(names)} entries but the shape {shape} has {len(shape)} dims"
        )

    entries: list = [None] * len(shape)
    notes: list[Note] = []
    not_divisible = unknown = False
    if names is not None:
        names = tuple(names)
        trailing = tuple(range(len(names), len(shape)))
        names = names + (None,) * len(trailing)
        for i, (d, e) in enumerate(zip(shape, logical_to_spec(names, rules, shard_axes))):
            kept = [a for a in as_tuple(e) if mesh.shape.get(a, 1) > 1]  # size-1 axes add nothing
            while kept and d % math.prod(mesh.shape[a] for a in kept):
                kept.pop()  # drop the innermost axis until the dim divides
            if d % axis_size(mesh, e):
                not_divisible = True
                notes.append(
                    Note(Why.NOT_DIVISIBLE, names=(names[i],), axes=as_tuple(e), dim=i, size=d, n=axis_size(mesh, e))
                )
            entries[i] = rule_entry(kept)
        unknown_names = tuple(n for n in names if n is not None and n not in rules)
        unknown = bool(unknown_names)
        mapped = tuple((n, as_tuple(e)) for n, e in zip(names, entries) if e is not None)
        head = [Note(Why.LOGICAL, mapped=mapped)]
        if trailing:
            head.append(Note(Why.UNNAMED_TRAILING, dims=trailing))
        if unknown_names:
            head.append(Note(Why.UNKNOWN_NAMES, names=unknown_names))
        notes = head + notes

    used = {a for e in entries for a in as_tuple(e)}
    on_group = any(a in used for a in group)
    needs_fallback = names is None or not_divisible or unknown
    if group_n == 1 or on_group or not needs_fallback:
        if names is None:
            notes.append(Note(Why.NO_SHARD_AXIS))
        return P(*entries), tuple(notes)
    if size < min_shard_size:
        notes.append(Note(Why.THRESHOLD, size=size, limit=min_shard_size))
        return P(*entries), tuple(notes)
    free = tuple(a for a in group if a not in used)
    n = math.prod(mesh.shape[a] for a in free)
    dim = _fallback_dim([d if entries[i] is None else 0 for i, d in enumerate(shape)], n) if n > 1 else None
    if dim is None or entries[dim] is not None:
        notes.append(Note(Why.UNSHARDABLE, axes=free or group, n=n if free else group_n))
        return P(*entries), tuple(notes)
    entries[dim] = rule_entry(free)
    notes.append(Note(Why.FALLBACK, dim=dim, size=shape[dim], axes=free, n=n))
    return P(*entries), tuple(notes)


def plan_leaf(
    path: str,
    shape: Sequence[int],
    dtype,
    names: Sequence[str | None] | None,
    mesh: Mesh,
    rules: Rules | None = None,
    shard_axes: Sequence[str] = (axes.FSDP,),
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
) -> tuple[LeafSharding, str | None]:
    """`decide_leaf` as an `explain` row: (row, problem), where problem is a message
    when the leaf should shard but no dim divides the shard group."""
    shape = tuple(int(d) for d in shape)
    try:
        spec, notes = decide_leaf(shape, names, mesh, rules, shard_axes, min_shard_size)
    except ShardingError as e:
        raise ShardingError(f"{path}: {e}") from None
    per_dev, total = _bytes_per_device(shape, dtype, spec, mesh)
    row = LeafSharding(path, shape, np.dtype(dtype).name, spec, per_dev, total, notes)
    problem = None
    if Why.UNSHARDABLE in row.kinds:
        group = tuple(a for a in shard_axes if mesh.shape.get(a, 1) > 1)
        problem = (
            f"{path}: shape {shape} ({math.prod(shape)} elements) has no dim divisible by "
            f"the shard group {'x'.join(group)}={axis_size(mesh, group)}"
        )
    return row, problem


def explain(
    params,
    mesh: Mesh,
    logical_axes=None,
    rules: Rules | None = None,
    shard_axes: Sequence[str] = (axes.FSDP,),
    min_shard_size: int = DEFAULT_MIN_SHARD_SIZE,
    allow_unshardable: bool = False,
) -> list[LeafSharding]:
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
        row, problem = plan_leaf(
            path_str(path), np.shape(leaf), leaf.dtype, nm, mesh, rules, shard_axes, min_shard_size
        )
        rows.append(row)
        if problem:
            problems.append(problem)
    if problems and not allow_unshardable:
        raise ShardingError(
            f"{len(problems)} parameter(s) cannot shard: "
            + "; ".join(problems)
            + ". Fix: pad that dim to a multiple of the shard group, pick an fsdp size "
            "that divides it, or annotate the leaf with logical names"
        )
    return rows


def specs_from_rows(params, rows: Sequence[LeafSharding]):
    """A tree of PartitionSpecs shaped like `params` from `explain` rows."""
    treedef = jax.tree.structure(params)
    return jax.tree.unflatten(treedef, [r.spec for r in rows])


def unknown_names(rows: Sequence[LeafSharding]) -> tuple[str, ...]:
    """Every logical name (sorted) that some row's rules table did not know."""
    return tuple(sorted({n for r in rows for note in r.notes if note.kind is Why.UNKNOWN_NAMES for n in note.names}))


def warn_unknown_names(rows: Sequence[LeafSharding], mesh: Mesh) -> tuple[str, ...]:
    """Warn (UnknownNamesWarning) naming the logical names the rules table does not
    map, and the `rules=` fix; names equal to a mesh axis (a model written against
    its own mesh, as Gemma's sharding config is) are suggested as mapping to it."""
    names = unknown_names(rows)
    if names:
        sizes = {a: int(n) for a, n in mesh.shape.items()}
        fix = ", ".join(f"{n!r}: {n!r}" if n in sizes else f"{n!r}: <mesh axis or None>" for n in names)
        no_tp = f" (so no dim shards over tensor={sizes[axes.TENSOR]})" if sizes.get(axes.TENSOR, 1) > 1 else ""
        warnings.warn(
            f"logical names not in the rules table get no mesh axis{no_tp}: {', '.join(names)}; "
            f"fix: rules={{**fsdp_jax.DEFAULT_RULES, {fix}}} (or mesh.rules in the YAML config)",
            UnknownNamesWarning,
            stacklevel=3,
        )
    return names
