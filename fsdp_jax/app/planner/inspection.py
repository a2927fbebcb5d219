"""What a compiled train step holds: its sharding rows, collectives, compiled memory,
per-collective schedule and the warnings they raise, for any model's compiled step
(`inspect_compiled`). `fsdp_jax.app.planner.one_strategy` runs it on the trainer's step."""

from __future__ import annotations

from typing import Any

import jax
import numpy as np

from fsdp_jax.app.planner.gathered_memory import compute_copy_bytes
from fsdp_jax.app.planner.report import replicated_threshold_for, sharding_warnings
from fsdp_jax.hlo.findings import schedule_warnings
from fsdp_jax.hlo.memory import collective_report, compiled_memory
from fsdp_jax.hlo.schedule import collective_schedule
from fsdp_jax.sharding import axes
from fsdp_jax.targets.gpu import dcn_groups


def inspect_compiled(
    plan,
    compiled,
    *,
    logical_axes=None,
    analytic_total: int | None = None,
    compute_dtype="float32",
    replicated_threshold: int | None = None,
) -> dict[str, Any]:
    """Rows, collectives, compiled memory and warnings for any compiled train step.

    `plan`: the ShardingPlan the step was made with; `compiled`: `step.lower(...).compile()`;
    `logical_axes`: the params' logical names (their `layers` dim marks the scanned
    stack, which enables the hoisted-gather check); `analytic_total`: an estimate to
    hold the compiled peak against. Works for any model: nothing here is Llama-specific.
    """
    mem = compiled_memory(compiled)
    report = collective_report(compiled.as_text())
    mesh = {k: int(v) for k, v in plan.mesh.shape.items()}
    abstract = jax.tree.unflatten(
        jax.tree.structure(plan.params), [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in plan.rows]
    )
    layer_gather = None
    if logical_axes is not None:
        # outside the layer loop only unstacked params (embedding, head) should be gathered,
        # in whatever dtype the program moves them (f32 on CPU even under bf16 compute)
        layer_gather = compute_copy_bytes(abstract, plan, logical_axes, "float32")["unstacked"]
    platform = plan.mesh.devices.flat[0].platform

    hosts = dcn_groups(list(plan.mesh.devices.flat))  # partition id -> host (GPU) or slice (TPU)
    schedule = collective_schedule(compiled.as_text(), hosts)
    threshold = replicated_threshold_for(sum(r.total_bytes for r in plan.rows), replicated_threshold)
    warnings = sharding_warnings(
        plan.rows,
        report,
        plan.strategy.name,
        mesh,
        analytic_total=analytic_total,
        compiled_peak=mem["peak"],
        layer_gather_bytes=layer_gather,
        cpu_upcast=platform == "cpu" and np.dtype(compute_dtype) != np.float32,
        replicated_threshold=threshold,
    )
    if platform != "cpu":  # XLA:CPU never reduce-scatters, upcasts bf16 and runs collectives in sync
        grad_axes = [a for a in plan.strategy.grads if mesh.get(a, 1) > 1]
        # batch axes the grads stay replicated over (HSDP's data axis): all-reduced by design
        replicated = int(np.prod([mesh.get(a, 1) for a in (axes.DATA, axes.FSDP) if a not in plan.strategy.grads]))
        warnings += schedule_warnings(
            schedule,
            compute_dtype=np.dtype(compute_dtype).name,
            shards_grads=bool(grad_axes),
            param_bytes_threshold=_param_sized(plan),
            replicated_group=replicated,
        )
    return {
        "mesh": mesh,
        "platform": platform,
        "rows": [r.as_dict() for r in plan.rows],
        "collectives": report,
        "compiled": mem,
        "warnings": warnings,
        "replicated_threshold": threshold,
        "schedule": schedule,
    }


def _param_sized(plan) -> int:
    """From how many bytes a collective counts as moving parameters / their grads: half
    the smallest sharded leaf (per layer when stacked: 3 or more dims), at least 4 KiB,
    so that norm scales and loss scalars never count."""
    axes_ = set(plan.strategy.params + plan.strategy.opt_state)
    sharded = [r for r in plan.rows if axes_ & set(jax.tree.leaves(tuple(r.spec)))]
    sizes = [r.total_bytes // (r.shape[0] if len(r.shape) > 2 else 1) for r in sharded]
    return max(1 << 12, min(sizes, default=1 << 21) // 2)
