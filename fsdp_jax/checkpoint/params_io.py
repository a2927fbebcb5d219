"""Params in and out of checkpoints as safetensors: export a checkpoint's params one
leaf at a time (host memory holds one array, the optimizer state is never read), load
a safetensors file straight into a sharded layout (each process reads only its
shards), and `load_init_params` for a run's `init_from` (a file or a run directory).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fsdp_jax.checkpoint.checkpointer import Checkpointer
from fsdp_jax.checkpoint.manifest import shape_mismatches, tree_paths
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from fsdp_jax.errors import CheckpointError, SafetensorsError


def export_safetensors(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | np.dtype | None = None,
    step: int | None = None,
    prefix: str = "params",
) -> dict:
    """Write the `prefix` subtree of a checkpoint as one safetensors file with keys like
    "blocks/attn/wq", one leaf at a time: host memory holds one array, the optimizer
    state is never read. `dtype` casts floating leaves (e.g. "bfloat16"). Uses the
    newest usable step unless `step` is given. Returns {"step", "tensors", "bytes", "path"}."""
    ckpt = Checkpointer(directory, read_only=True)
    cast = None if dtype is None else np.dtype(dtype)

    def meta(s):
        leaves = {p[len(prefix) + 1 :]: m for p, m in ckpt.saved_metadata(s).items() if p.startswith(prefix + "/")}
        if not leaves:
            raise CheckpointError(f"{ckpt.step_dir(s)}: no '{prefix}' subtree in the saved state")
        return leaves

    leaves, s, notes = ckpt._try_steps(step, meta)
    for n in notes:
        print(f"warning: {n}", flush=True)

    def out_dtype(m):
        dt = np.dtype(m.dtype)
        return cast if cast is not None and np.issubdtype(dt, np.floating) else dt

    entries = [(name, tuple(m.shape), out_dtype(m)) for name, m in sorted(leaves.items())]
    size = write_safetensors(
        out,
        entries,
        lambda name: ckpt.read_leaf(s, f"{prefix}/{name}"),
        {"format": "np", "fsdp_jax_step": str(s), "source": str(ckpt.step_dir(s))},
    )
    return {"step": s, "tensors": len(leaves), "bytes": size, "path": str(out)}


def open_safetensors(path: str | os.PathLike) -> SafetensorsFile:
    """The checked header of a safetensors file (no data is read yet); a missing or
    invalid file is a CheckpointError naming it."""
    try:
        return SafetensorsFile(path)
    except SafetensorsError as e:
        raise CheckpointError(str(e)) from None


def load_safetensors(path: str | os.PathLike, abstract_params) -> Any:
    """Params from a safetensors file, laid out as `abstract_params` (ShapeDtypeStructs;
    with a sharding each process reads only its shards' rows) and cast to their dtypes.
    Missing/extra names or shapes that differ raise CheckpointError listing them."""
    f = open_safetensors(path)
    want = tree_paths(abstract_params)
    bad = shape_mismatches({n: jax.ShapeDtypeStruct(f.shape(n), f.dtype(n)) for n in f.tensors}, want)
    if bad:
        raise CheckpointError(f"{path} does not fit the model ({'; '.join(bad)})")

    def place(name, sds):
        if getattr(sds, "sharding", None) is None:
            return jax.device_put(f.read(name, dtype=sds.dtype))  # jnp.asarray: a `stage` compile per shape
        return jax.make_array_from_callback(sds.shape, sds.sharding, lambda idx: f.read(name, *idx, dtype=sds.dtype))

    try:
        leaves = [place(name, sds) for name, sds in want.items()]
    except SafetensorsError as e:  # the file changed (truncated) after its header was checked
        raise CheckpointError(str(e)) from None
    return jax.tree.unflatten(jax.tree.structure(abstract_params), leaves)


def load_init_params(path: str | os.PathLike, abstract_params) -> Any:
    """Params for a run's `init_from`, laid out as `abstract_params` (ShapeDtypeStructs
    with shardings): a safetensors file (scripts/export.py) or a run / checkpoint
    directory (its newest step that restores; only params are read, damaged steps are
    reported on process 0). Failures raise CheckpointError("init_from: ...")."""
    p = Path(path)
    try:
        if p.is_file() or p.suffix == ".safetensors":
            return load_safetensors(p, abstract_params)
        d = p / "checkpoints" if (p / "checkpoints").is_dir() else p
        if not d.is_dir():
            raise CheckpointError(f"{path}: no such file or directory")
        params, _, notes = Checkpointer(d, read_only=True, keep=None).restore_params(abstract_params)
        for n in notes:
            if jax.process_index() == 0:
                print(f"warning: {n}", flush=True)
        return params
    except CheckpointError as e:
        raise CheckpointError(f"init_from: {e}") from None
