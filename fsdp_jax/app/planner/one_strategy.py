"""One strategy of a config, built, analysed and AOT-compiled in this process
(`plan_strategy`): analytic memory, compiled memory with its host/device split,
collectives, communication and warnings, as one JSON-able dict. Many strategies, in a
child process when this one lacks the devices: `fsdp_jax.app.planner.compile_child`."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import jax

from fsdp_jax.app.objectives.grpo_run import is_grpo
from fsdp_jax.app.planner import nvme_plan
from fsdp_jax.app.planner.abstract_step import build_step
from fsdp_jax.app.planner.grpo_plan import plan_generation
from fsdp_jax.app.planner.inspection import inspect_compiled
from fsdp_jax.app.planner.memory_model import activations_by_remat, analytic_memory, argument_bytes
from fsdp_jax.app.planner.refusal import over_memory, refused_result
from fsdp_jax.errors import OffloadError
from fsdp_jax.hlo.costs import op_inventory
from fsdp_jax.hlo.schedule import communication
from fsdp_jax.sharding import rules
from fsdp_jax.sharding.offload import entry_argument_bytes
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.replication import check_sufficiently_sharded
from fsdp_jax.targets.gpu import dcn_groups
from fsdp_jax.targets.tpu import tile_padding


def plan_strategy(
    cfg,
    strategy: str,
    devices: Sequence[jax.Device] | None = None,
    *,
    inspect: bool = False,
    replicated_threshold: int | None = None,
    mesh_sizes: tuple[int, int, int] | None = None,
    step_options: dict[str, Any] | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Build, analyse and AOT-compile one strategy in this process (needs the devices:
    real, fake CPU, or compile-only GPU-target devices from `fsdp_jax.targets.gpu`).
    Returns a JSON-able dict: mesh, analytic, compiled, argument_vs_analytic, compile_s,
    collectives_per_step, activations_by_remat, replicated_fraction, warnings; with
    `inspect`, also rows, the full collective report and the per-collective `schedule`
    (`fsdp_jax.hlo.schedule.collective_schedule`)."""
    t0 = time.perf_counter()
    try:
        b = build_step(cfg, strategy, devices, mesh_sizes, **(step_options or {}))
    except OffloadError:
        if not devices or devices[0].platform != "gpu":
            raise  # compile-only GPU devices: no host memory kind (fsdp_jax.app.planner.target_offload)
        from fsdp_jax.app.planner.target_offload import plan_without_host_memory

        return plan_without_host_memory(
            plan_strategy,
            cfg,
            strategy,
            devices,
            devices[0].device_kind,
            inspect=inspect,
            replicated_threshold=replicated_threshold,
            mesh_sizes=mesh_sizes,
            step_options=step_options,
            compiler_options=compiler_options,
        )
    analytic = analytic_memory(b)
    try:
        compiled = b.compile(compiler_options)
    except Exception as e:  # XLA:TPU refuses a program that cannot fit its HBM
        refused = over_memory(e)
        if refused is None:
            raise
        return refused_result(b, cfg, analytic, refused, time.perf_counter() - t0)
    compile_s = time.perf_counter() - t0
    layout_note = None
    if b.mesh.devices.flat[0].platform == "tpu":  # XLA:TPU pads every argument to its layout's tiles
        try:
            analytic["tile_padding"] = tile_padding((b.state, b.batch), compiled)
            analytic["total"] += analytic["tile_padding"]
        except ValueError as e:  # jax 0.10.2: input_formats of a microbatched splash step (more formats than leaves)
            layout_note = f"XLA:TPU's input layouts unreadable ({e}): the analytic total leaves their tile padding out"
    ins = inspect_compiled(
        b.plan,
        compiled,
        logical_axes=b.model.logical_axes,
        analytic_total=analytic["total"],
        compute_dtype=Policy.parse(cfg.precision).compute_dtype,
        replicated_threshold=replicated_threshold,
    )
    mem = ins["compiled"]
    mem.update(_compiled_host(compiled, mem))
    out = _result(cfg, b, analytic, ins, compile_s)
    if nvme_plan.is_nvme(cfg.offload):  # the program without offload: split as the nvme step runs it
        nvme_plan.complete_compiled(out)
    if layout_note:
        out["warnings"].append(layout_note)
    if ins["platform"] != "cpu":  # a target's compiled program: its ops for the step-time model
        out.update(_ops(compiled, b.mesh))
    if is_grpo(cfg):  # the generation's programs on the same mesh (KV cache, prefill, decode step)
        out["grpo"] = plan_generation(b, compiler_options, ops=ins["platform"] != "cpu")
    if inspect:
        out["rows"] = ins["rows"]
        out["collectives"] = ins["collectives"]
        out["replicated_threshold"] = ins["replicated_threshold"]
        out["schedule"] = ins["schedule"]
    return out


def _result(cfg, b, analytic: dict[str, int], ins: dict[str, Any], compile_s: float) -> dict[str, Any]:
    """`plan_strategy`'s dict for the compiled step `b` (a `step_build.StepBuild`) from its
    `inspect_compiled` findings `ins`; with whether the trainer would accept its plan
    (`replicated_fraction`, else a warning)."""
    mem = ins["compiled"]
    out: dict[str, Any] = {
        "mesh": ins["mesh"],
        "analytic": analytic,
        "compiled": {
            k: mem[k]
            for k in (
                "argument",
                "output",
                "alias",
                "temp",
                "peak",
                "xla_peak",
                "device_argument",
                "host_argument",
                "device_peak",
                "host_reported",
            )
        },
        "offload": cfg.offload,
        "argument_vs_analytic": mem["argument"] / argument_bytes(analytic) - 1,
        "compile_s": round(compile_s, 2),
        "platform": ins["platform"],
        "collectives_per_step": ins["collectives"]["per_step"],
        "communication": communication(ins["schedule"]),
        "activations_by_remat": activations_by_remat(b),
        "warnings": ins["warnings"],
    }
    try:
        out["replicated_fraction"] = check_sufficiently_sharded(
            b.plan.rows, b.plan.strategy.params, b.mesh, cfg.mesh.max_replicated_fraction, cfg.mesh.min_replicated_bytes
        )
    except rules.ShardingError as e:
        out["replicated_fraction"] = None
        out["warnings"].insert(0, f"the trainer would refuse this plan: {e}")
    return out


def _compiled_host(compiled, mem: dict[str, int]) -> dict[str, int]:
    """Host/device split of a compiled step's memory: `device_argument` / `host_argument`
    from the parameter layouts of the compiled program (host-resident = memory space
    S(5)); `host_reported`: memory_analysis()'s host bytes (argument + temp + output -
    alias; 0 where the backend does not report them, e.g. CPU); `device_peak`: the peak
    without host-resident bytes (on such backends, the peak minus the host arguments)."""

    ma = compiled.memory_analysis()
    host = {k: int(getattr(ma, f"host_{k}_size_in_bytes", 0) or 0) for k in ("argument", "output", "alias", "temp")}
    reported = host["argument"] + host["output"] - host["alias"] + host["temp"]
    entry = entry_argument_bytes(compiled.as_text())
    device_peak = mem["peak"] if reported else mem["peak"] - entry["host"]
    return {
        "device_argument": entry["device"],
        "host_argument": entry["host"],
        "host_reported": reported,
        "device_peak": device_peak,
    }


def _ops(compiled, mesh) -> dict[str, Any]:
    """The compiled program's `op_inventory` (fsdp_jax.hlo.costs) and the seconds the op walk
    took (`op_inventory_s`: part of what the prediction costs on top of the compile)."""

    t0 = time.perf_counter()
    ops = op_inventory(compiled.as_text(), dcn_groups(list(mesh.devices.flat)))
    return {"op_inventory": ops, "op_inventory_s": round(time.perf_counter() - t0, 3)}
