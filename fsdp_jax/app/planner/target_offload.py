"""Host offload planned on a compile-only GPU target: the device side from the target's
compile, the host side by formula. One concept: what `plan.py --target ... --offload X`
reports where XLA cannot compile the offloaded program.

The CUDA plugin's compile-only devices offer no `pinned_host` memory kind (jax 0.10.2 and
0.12.0.1; `fsdp_jax.sharding.offload.check_supported` refuses an offload there), so the offloaded step
is not compiled for the target. Instead:

    device side = the target compile of the same step without offload
                  - the state that offload moves to the host (analytic, exact: shard bytes)
                  + what comes back transiently (the compute copy of offloaded params,
                    one leaf's state during the update; `memory_model.offload_memory`)
    host side   = the offloaded state's shard bytes per device (analytic)

The argument bytes of the offload-free compile equal the plan's exactly (params +
optimizer + batch: `tests/test_targets.py`), so subtracting the host-resident part of
them is exact; the transient terms are the analytic model's.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fsdp_jax.app.planner.abstract_step import build_step
from fsdp_jax.app.planner.memory_model import offload_memory

BASIS = "device_side_from_target_compile_host_side_analytic"


def note(device_kind: str, offload: str) -> str:
    """The one line a plan carries for such a result."""
    return (
        f"offload {offload} on a GPU target: compile-only {device_kind} devices have no pinned_host "
        f"memory kind, so device = this step compiled for them without offload - the state resting "
        f"on the host + its transient device copies; host = analytic (fsdp_jax.app.planner.target_offload)"
    )


def plan_without_host_memory(
    plan_fn: Callable[..., dict[str, Any]], cfg, strategy: str, devices, device_kind: str, **kwargs
) -> dict[str, Any]:
    """`plan_fn(cfg', strategy, devices, **kwargs)` for `cfg` with offload none (compiled on
    the target), its analytic and compiled terms completed with the host/device split of
    `cfg.offload`. `plan_fn` is `planner.plan_strategy`."""

    plain = dataclasses.replace(cfg, offload="none")
    r = plan_fn(plain, strategy, devices, **kwargs)
    b = build_step(plain, strategy, devices, kwargs.get("mesh_sizes"), **(kwargs.get("step_options") or {}))
    split = offload_memory(b, r["analytic"], offload=cfg.offload)
    r["analytic"].update(split)
    c = r["compiled"]
    moved_back = split["device_total"] - (r["analytic"]["total"] - split["host"])  # transient copies
    c["host_argument"] = split["host"]
    c["device_argument"] = c["argument"] - split["host"]
    c["device_peak"] = c["peak"] - split["host"] + moved_back
    c["host_reported"] = 0
    r["offload"] = cfg.offload
    r["offload_basis"] = BASIS
    r["warnings"].insert(0, note(device_kind, cfg.offload))
    return r
