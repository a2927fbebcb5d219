"""Bytes per device: analytic (from shardings) and compiled (memory_analysis), and
which collectives the compiled program runs, inside or outside the layer loop."""

from __future__ import annotations

import math
import re
from collections import Counter
from typing import Any

import jax
import numpy as np

from fsdp_jax.hlo import schedule
from fsdp_jax.hlo.schedule import COLLECTIVES

_COLLECTIVE_RE = {op: re.compile(rf"\s{op}(-start)?\(") for op in COLLECTIVES}


def shard_bytes(x) -> int:
    """Bytes one device holds of `x` (array or ShapeDtypeStruct with a sharding);
    the largest shard when the split is uneven."""
    shape = tuple(x.shape)
    sharding = getattr(x, "sharding", None)
    if sharding is not None:
        shape = sharding.shard_shape(shape)
    return math.prod(shape) * np.dtype(x.dtype).itemsize


def tree_bytes_per_device(tree) -> int:
    return sum(shard_bytes(x) for x in jax.tree.leaves(tree))


def tree_bytes(tree) -> int:
    """Total (unsharded) bytes of a tree."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(tree))


def state_bytes_per_device(abstract_state) -> dict[str, int]:
    """Per-device bytes of a TrainState of sharded ShapeDtypeStructs (or arrays):
    `params`, `opt_state`, `step`, `model_state` (only for a model with non-trainable
    state: BatchNorm statistics, ...) and `total`."""
    out = {
        "params": tree_bytes_per_device(abstract_state.params),
        "opt_state": tree_bytes_per_device(abstract_state.opt_state),
        "step": tree_bytes_per_device(abstract_state.step),
    }
    if getattr(abstract_state, "model_state", None) is not None:
        out["model_state"] = tree_bytes_per_device(abstract_state.model_state)
    out["total"] = sum(out.values())
    return out


def compiled_memory(compiled) -> dict[str, int]:
    """`memory_analysis()` of a compiled step, per device: argument, output, alias,
    temp, generated code, and the peak.

    `peak` is argument + output - alias + temp, or XLA's own `peak_memory_in_bytes`
    when that is larger; `xla_peak` is XLA's figure as reported (XLA:CPU reports
    roughly the argument bytes there, leaving out temp, so it is not used alone).
    """
    ma = compiled.memory_analysis()
    out = {
        "argument": int(ma.argument_size_in_bytes),
        "output": int(ma.output_size_in_bytes),
        "alias": int(ma.alias_size_in_bytes),
        "temp": int(ma.temp_size_in_bytes),
        "code": int(getattr(ma, "generated_code_size_in_bytes", 0)),
    }
    out["xla_peak"] = int(getattr(ma, "peak_memory_in_bytes", 0) or 0)
    out["peak"] = max(out["xla_peak"], out["argument"] + out["output"] - out["alias"] + out["temp"])
    return out


# ----------------------------------------------------------------------------- HLO


def collective_report(hlo: str) -> dict[str, Any]:
    """Count collectives in compiled HLO text, split into those inside a while loop
    (the scanned layer loop, or the microbatch loop) and outside.

    Returns {"inside_loop": {op: entry}, "outside_loop": {op: entry}, "per_step":
    {op: {"count", "bytes"}}, "loops": [{"body", "parent", "trip_count", "op_name"}]}.
    Each entry: `count` and `bytes` (per device, result sizes; an async start/done
    pair counts once, a combined collective sums its elements) as the instructions
    appear in the program, `runs` and `bytes_per_step`: the same multiplied by how
    many times their computation runs per step (a while body runs `known_trip_count`
    times, from the while op's backend_config; nested loops multiply), `dtypes` (HLO
    dtype -> number of results in it), and `op_names`: the JAX source ops
    (`transpose(jvp(...))` marks the backward pass). For all-gather the result is the
    gathered buffer; for reduce-scatter it is the shard (the operand is group-size
    times larger). Per-collective detail (phase, async, overlap, groups):
    `fsdp_jax.hlo.schedule.collective_schedule`.
    """
    comps, _ = schedule.parse_computations(hlo)
    _, loops = schedule.call_graph(comps)
    report: dict[str, Any] = {"inside_loop": {}, "outside_loop": {}}
    for c in schedule.collective_schedule(hlo):
        where = "inside_loop" if c["loop"] else "outside_loop"
        e = report[where].setdefault(
            c["op"], {"count": 0, "bytes": 0, "runs": 0, "bytes_per_step": 0, "dtypes": Counter(), "op_names": []}
        )
        e["count"] += 1
        e["bytes"] += c["bytes"]
        e["runs"] += c["runs"]
        e["bytes_per_step"] += c["bytes_per_step"]
        e["dtypes"].update(c["hlo_dtypes"])
        e["op_names"].append(c["op_name"])
    for where in ("inside_loop", "outside_loop"):
        for e in report[where].values():
            e["dtypes"] = dict(e["dtypes"])
    report["per_step"] = schedule.schedule_totals(schedule.collective_schedule(hlo))
    report["loops"] = loops
    return report


def collective_ops(hlo: str) -> list[tuple[str, str]]:
    """(op, instruction line) for every collective in the HLO text, in order."""
    out = []
    for line in hlo.splitlines():
        for op, rx in _COLLECTIVE_RE.items():
            if rx.search(line):
                out.append((op, line.strip()))
    return out
