"""Build the (`data`, `fsdp`, `context`, `tensor`) device mesh."""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import mesh_utils
from jax.sharding import AxisType, Mesh

from fsdp_jax.errors import MeshError
from fsdp_jax.sharding.axes import MESH_AXES


def resolve_mesh_shape(sizes: Sequence[int], n_devices: int) -> tuple[int, ...]:
    """Fill one -1 entry of `sizes` (one per axis of MESH_AXES) so their product is `n_devices`.

    Raises MeshError naming the sizes and the device count when that is impossible.
    """
    sizes = tuple(int(s) for s in sizes)
    named = ", ".join(f"{a}={s}" for a, s in zip(MESH_AXES, sizes))
    if sum(s == -1 for s in sizes) > 1:
        raise MeshError(f"mesh sizes ({named}): at most one axis may be -1")
    if any(s == 0 or s < -1 for s in sizes):
        raise MeshError(f"mesh sizes ({named}): each size must be a positive integer or -1")
    known = math.prod(s for s in sizes if s != -1)
    if -1 in sizes:
        if n_devices % known:
            raise MeshError(
                f"mesh sizes ({named}) cannot fill {n_devices} devices: {n_devices} is not divisible by {known}"
            )
        sizes = tuple(n_devices // known if s == -1 else s for s in sizes)
    if math.prod(sizes) != n_devices:
        raise MeshError(
            f"mesh sizes ({named}) multiply to {math.prod(sizes)} but there are "
            f"{n_devices} devices; make the product {n_devices} or set one size to -1"
        )
    return sizes


AXIS_TYPES = {"auto": AxisType.Auto, "explicit": AxisType.Explicit}


def make_mesh(
    data: int = 1,
    fsdp: int = -1,
    tensor: int = 1,
    devices: Sequence[jax.Device] | None = None,
    axis_types: str = "auto",
    context: int = 1,
) -> Mesh:
    """Mesh with axes (`data`, `fsdp`, `context`, `tensor`), all of one axis type.

    One size may be -1 to take the remaining devices. With several processes the
    `data` axis spans processes (DCN) and `fsdp` x `tensor` stay within one
    process (ICI) when the per-process device count allows it. `context` > 1 splits
    each sequence over that many devices (`fsdp_jax.attention.ring`).

    `axis_types`: "auto" (the default) lets the partitioner place params and insert
    FSDP's collectives where it schedules best: under a layer scan it gathers each
    layer inside the loop, which is FSDP's memory saving; models annotate
    activations with logical constraints. "explicit" is JAX's sharding-in-types mode,
    for models written for it (`out_sharding=` on ops, `jax.sharding.reshard`):
    every array carries its sharding, and the train step reshards where Auto
    constrains (`constrain`).
    """
    if axis_types not in AXIS_TYPES:
        raise MeshError(f"axis_types {axis_types!r}: choose one of {', '.join(AXIS_TYPES)}")
    devices = list(jax.devices() if devices is None else devices)
    shape = resolve_mesh_shape((data, fsdp, context, tensor), len(devices))
    axis_types = (AXIS_TYPES[axis_types],) * len(MESH_AXES)
    n_proc = len({d.process_index for d in devices})
    per_proc = len(devices) // n_proc
    if n_proc > 1 and shape[0] % n_proc == 0 and math.prod(shape[1:]) * (shape[0] // n_proc) == per_proc:
        grid = mesh_utils.create_hybrid_device_mesh(
            (shape[0] // n_proc, *shape[1:]),
            (n_proc,) + (1,) * (len(shape) - 1),
            devices=devices,
            process_is_granule=True,
        )
        return Mesh(grid, MESH_AXES, axis_types=axis_types)
    if devices == list(jax.devices()):
        return jax.make_mesh(shape, MESH_AXES, axis_types=axis_types)
    return Mesh(np.asarray(devices).reshape(shape), MESH_AXES, axis_types=axis_types)


def is_explicit(mesh) -> bool:
    """True when every axis of `mesh` has the Explicit type (JAX's sharding-in-types
    mode: arrays carry their sharding, `with_sharding_constraint` only asserts)."""
    types = getattr(mesh, "axis_types", ())
    return bool(types) and all(t == AxisType.Explicit for t in types)


def constrain(tree, shardings):
    """Lay `tree` out as `shardings` (a matching tree of NamedShardings, or one for
    every leaf) inside a traced function: `with_sharding_constraint` on Auto meshes
    (a hint the partitioner may move data for), `jax.sharding.reshard` on Explicit
    meshes (where a constraint would only assert)."""
    leaves = jax.tree.leaves(shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding))
    if leaves and is_explicit(leaves[0].mesh):
        if isinstance(shardings, jax.sharding.Sharding):
            return jax.tree.map(lambda x: jax.sharding.reshard(x, shardings), tree)
        return jax.tree.map(jax.sharding.reshard, tree, shardings)
    return jax.lax.with_sharding_constraint(tree, shardings)
