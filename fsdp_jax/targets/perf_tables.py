"""The step-time model's constants per target, from one data file (`perf_tables.json`).

    t = perf_table("h100")   # {"peak_flops": {...}, "gemm": {...}, "attention": {...}, "hbm": {...},
                             #  "links": {"fast": {...}, "slow": {...}}, "host": {...}}
    device_kind_peaks()      # {"h100": {"bf16": 989e12, ...}, ...}: the peaks MFU divides by

Every entry carries its `source` (a published figure, an assumption, or "fitted" and to
what; docs/step_time.md lists them). A GPU entry may say `same_as` another and override
parts; a TPU generation takes its peaks, HBM, ICI and DCN bandwidths from
`fsdp_jax.targets.tpu` (the Cloud TPU pages' figures), the rest from the `tpu` entry, and
what differs by generation (the MXU's width, a published GEMM efficiency) from a `tpu.<gen>`
entry (`tpu.v6e`), merged into it section by section.
"""

from __future__ import annotations

import copy
import functools
import json
from importlib import resources
from typing import Any

from fsdp_jax.targets.tpu import TPU_SPECS, device_peaks


@functools.cache
def _tables() -> dict[str, Any]:
    return json.loads(resources.files("fsdp_jax.targets").joinpath("perf_tables.json").read_text())


def perf_table(target: str) -> dict[str, Any]:
    """The constants for `target` (a GPU name in the table, or a TPU generation / slice
    name such as `v5p` or `v5p-512`). Raises ValueError for a target it has no figures for."""
    tables = _tables()
    if target in tables and not target.startswith(("_", "tpu")):
        t = copy.deepcopy(tables[target])
        base = t.pop("same_as", None)
        return {**copy.deepcopy(tables[base]), **t} if base else t

    try:
        p = device_peaks(target)
    except (KeyError, ValueError) as e:
        raise ValueError(f"no step-time figures for target {target!r} ({e})") from None
    t = copy.deepcopy(tables["tpu"])
    for section, values in tables.get(f"tpu.{target.split('-')[0]}", {}).items():
        t[section] = {**t.get(section, {}), **copy.deepcopy(values)}
    t["peak_flops"] = {"bf16": p["flops"], "f32": p["flops"], "source": "fsdp_jax.targets.tpu.TPU_SPECS"}
    t["hbm"]["bytes_per_s"] = p["hbm"]
    fast, slow = t["links"]["fast"], t["links"]["slow"]
    fast["bus_bytes_per_s"] = p["fast"] * fast["efficiency"]
    slow["bus_bytes_per_s"] = p["slow"] * slow["efficiency"] if p["slow"] else None
    t["attention"] = None  # no cuDNN kernel: attention is XLA fusions (GEMMs + memory-bound ops)
    return t


def device_kind_peaks() -> dict[str, dict[str, float]]:
    """Peak FLOP/s of one device (a chip) per dtype key (`bf16`, `f16`, `f32`, ...), by a
    part of jax's `device_kind` (lower case; the table's order, first match wins): the
    table's `_device_kinds` entry, which names a GPU entry (its `peak_flops`), a TPU
    generation (`TPU_SPECS`' per-chip bf16 peak, for bf16 and f32) or gives its own."""
    out = {}
    for kind, entry in _tables()["_device_kinds"].items():
        if kind.startswith("_"):
            continue
        if isinstance(entry, dict):
            peaks = entry
        elif entry in TPU_SPECS:
            peaks = dict.fromkeys(("bf16", "f32"), TPU_SPECS[entry].peak_bf16_flops)
        else:
            peaks = perf_table(entry)["peak_flops"]
        out[kind] = {k: v for k, v in peaks.items() if k != "source"}
    return out
