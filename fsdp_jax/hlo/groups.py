"""The replica groups of an HLO collective as lists of device ids, from any of XLA's
spellings (explicit lists, iota specs, named-axis meshes, a permute's source-target
pairs). `fsdp_jax.hlo.schedule` takes each collective's group size and whether it crosses
hosts from these (and re-exports `replica_groups`)."""

from __future__ import annotations

import math
import re

import numpy as np


def replica_groups(line: str, n_devices: int | None = None) -> list[list[int]] | None:
    """The replica groups of a collective line as lists of device ids, from any of
    XLA's spellings: {{0,1},{2,3}}; [2,4]<=[8]; [4,2]<=[2,4]T(1,0); mesh['a'=4,'b'=2]
    (optionally device_ids=([2,4]T(1,0))) {'b'}; {} (all devices). None if unknown."""
    m = re.search(r"replica_groups=mesh\[([^\]]*)\](?:,\s*device_ids=\(([^)]*\)?)\))?\s*\{([^}]*)\}", line)
    if m:
        axes = re.findall(r"'([^']+)'=(\d+)", m.group(1))
        sizes = [int(s) for _, s in axes]
        ids = np.arange(math.prod(sizes))
        if m.group(2):
            ids = _iota(m.group(2), math.prod(sizes))
        ids = ids.reshape(sizes)
        keep = [a.strip().strip("'") for a in m.group(3).split(",") if a.strip()]
        idx = [i for i, (a, _) in enumerate(axes) if a in keep]
        rest = [i for i in range(len(axes)) if i not in idx]
        grid = ids.transpose(rest + idx).reshape(-1, math.prod(sizes[i] for i in idx) if idx else 1)
        return grid.tolist()
    m = re.search(r"replica_groups=(\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?)", line)
    if m:
        dims = [int(x) for x in re.match(r"\[([\d,]+)\]", m.group(1)).group(1).split(",")]
        ids = _iota(m.group(1).split("<=", 1)[1], math.prod(dims))
        return ids.reshape(dims[0], -1).tolist()
    m = re.search(r"replica_groups=\{((?:\{[\d,\s]*\},?\s*)*)\}", line)
    if m is not None:
        groups = re.findall(r"\{([\d,\s]*)\}", m.group(1))
        if groups:
            return [[int(x) for x in g.split(",") if x.strip()] for g in groups]
        return [list(range(n_devices))] if n_devices else None
    m = re.search(r"source_target_pairs=\{(.*?)\}\}", line)
    if m:
        return [[int(a), int(b)] for a, b in re.findall(r"\{(\d+),(\d+)", m.group(0))]
    return None


def _iota(spec: str, n: int) -> np.ndarray:
    """Device ids of an iota spec '[2,4]T(1,0)' or '[8]' (flattened)."""
    m = re.match(r"\[([\d,]+)\](?:T\(([\d,]+)\))?", spec.strip())
    if not m:
        return np.arange(n)
    dims = [int(x) for x in m.group(1).split(",")]
    ids = np.arange(math.prod(dims)).reshape(dims)
    if m.group(2):
        ids = ids.transpose([int(x) for x in m.group(2).split(",")])
    return ids.reshape(-1)
