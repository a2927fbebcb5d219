"""A program the target's compiler refused for memory: XLA:TPU does not emit a program
whose temporaries exceed the chip's HBM (XLA:GPU and XLA:CPU do). `over_memory` reads
the refusal; `refused_result` is the strategy's result built from it (no schedule)."""

from __future__ import annotations

import re
from typing import Any

from fsdp_jax.app.planner.memory_model import activations_by_remat

_OOM = re.compile(
    r"RESOURCE_EXHAUSTED: Ran out of memory in memory space (\w+)|"
    r"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
    r"temporaries \(([\d.]+)([KMGTP]?)\) exceeds available HBM \(([\d.]+)([KMGTP]?)\)"
)


def _xla_bytes(number: str, unit: str) -> int:
    """XLA's human-readable bytes ('104.34G': binary prefixes) as an int."""
    return int(float(number) * 1024 ** ("KMGTP".index(unit) + 1 if unit else 0))


def over_memory(error: Exception) -> dict[str, int] | None:
    """{"temp", "available"} bytes when `error` is XLA:TPU refusing to compile a program whose
    temporaries exceed the chip's HBM (it does not emit such a program, where XLA:GPU and
    XLA:CPU do); None for any other error."""
    m = _OOM.search(str(error))
    if m is None or m.group(2) is None:
        return None
    return {"temp": _xla_bytes(m.group(2), m.group(3)), "available": _xla_bytes(m.group(4), m.group(5))}


def refused_result(b, cfg, analytic: dict[str, int], refused: dict[str, int], compile_s: float) -> dict[str, Any]:
    """A strategy the target's compiler refused for memory: the argument bytes from the plan
    (equal to the compiled ones wherever a compile succeeds), the temporaries XLA said it
    needs, and no schedule."""
    argument = analytic["params"] + analytic["optimizer"] + analytic["batch"]
    peak = argument + refused["temp"]
    mesh = {k: int(v) for k, v in b.plan.mesh.shape.items()}
    return {
        "mesh": mesh,
        "analytic": analytic,
        "compiled": {
            "argument": argument,
            "output": 0,
            "alias": 0,
            "temp": refused["temp"],
            "peak": peak,
            "xla_peak": None,
            "device_argument": argument,
            "host_argument": 0,
            "device_peak": peak,
            "host_reported": 0,
        },
        "refused": refused,
        "offload": cfg.offload,
        "argument_vs_analytic": 0.0,
        "compile_s": round(compile_s, 2),
        "platform": b.plan.mesh.devices.flat[0].platform,
        "collectives_per_step": {},
        "communication": {},
        "activations_by_remat": activations_by_remat(b),
        "replicated_fraction": None,
        "warnings": [
            f"the compiler refused this program: its temporaries need {refused['temp'] / 1e9:.2f} GB "
            f"and the chip offers {refused['available'] / 1e9:.2f} GB, so it does not fit; "
            f"compiled argument/peak are the plan's argument bytes + those temporaries"
        ],
    }
