"""The fastest configuration that fits: a search over strategy, remat policy, microbatches
and host offload (and, when asked, batch and sequence length), cheap first.

    space = SearchSpace(offloads=("none", "optimizer", "optimizer+params"))
    doc = search(cfg, 8, space, Limits(device_memory=80 * 10**9), target=make_target("h100", 8))
    doc["winner"]["overrides"]   # ["mesh.strategy=full_shard", "remat=dots", ...]

1. Enumerate every candidate the config's mesh and batch allow.
2. Analytic pass (no compile): the memory model (`memory_model.analytic_memory`) on the
   trainer's abstract step, built once per strategy x offload (the variable terms,
   activations, batch and the microbatch accumulator, come from each candidate's config),
   and a predicted step time (`step_time.predict_roofline` over the analytic collective
   bytes below, with the op-by-op model's table: its peak x GEMM efficiency, links and HBM;
   plus the remat recompute and the host<->device transfers of offload). Prune a candidate only when even
   the analytic model's largest measured overestimate (`ANALYTIC_OVER`) cannot bring it
   under the budget (device memory minus headroom; params, optimizer state and batch are
   exact, only the transient rest carries that error: `lower_bound`), so no candidate whose
   compiled program would fit is dropped here.
3. Rank by predicted tokens/s per device: a GPU, or a TPU chip with that generation's
   figures (`ranking_target`; without a target, or across slices of a TPU generation
   whose data-center bandwidth is unpublished: by the same roofline with H100 figures, an
   analytic cost and not a prediction for this machine).
4. Compile only a few (`Limits.top` best-ranked that fit analytically, `Limits.edge`
   best-ranked just over the edge), all in one child process sharing XLA:GPU's kernel
   cache (on CPU, in this process with the persistent compilation cache). A compiled
   candidate fits when its compiled device peak is within the budget; its prediction is
   then redone op by op from the compiled program (`step_time.predict_ops`: the step `plan
   --target` reports for the same config). Another round follows
   while an uncompiled candidate still ranks above the best verified fit, up to
   `Limits.max_compiles` compiles in all.

Candidates with state offload compile on a GPU target as `plan.py --target ... --offload X`
does: compile-only GPU devices offer no host memory kind, so the step compiles without
offload and its device side is that compile minus the state resting on the host plus its
transient device copies (`fsdp_jax.app.planner.target_offload`). Elsewhere (TPU targets, CPU,
where XLA:CPU moves nothing between memory kinds) and for offloading remat policies they
are judged by the analytic model only.
Here: the search itself (`search`) and its document. The cost model (communication,
recompute, predicted step) is `fsdp_jax.app.planner.search_prediction`, step 2
`fsdp_jax.app.planner.search_analytic`, ranking and the compile rounds
`fsdp_jax.app.planner.search_rounds`, compiling `fsdp_jax.app.planner.search_compile`; their names
are importable from here too. The user's side (flags, table, YAML) is
`fsdp_jax.app.planner.search_report`.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from fsdp_jax.app.config.fp8_checks import target_platform, unscaled_experts, unscaled_experts_line, unscaled_kernels
from fsdp_jax.app.models.lora import adapter_param_count, spec_from_config
from fsdp_jax.app.planner import nvme_plan
from fsdp_jax.app.planner.abstract_step import mesh_shape, target_mesh_sizes
from fsdp_jax.app.planner.residuals import rematerialised
from fsdp_jax.app.planner.search_analytic import analytic_pass
from fsdp_jax.app.planner.search_prediction import (
    ranking_target,
)
from fsdp_jax.app.planner.search_rounds import (
    compile_rounds,
    device_peak,
    rank,
    verified,
)
from fsdp_jax.app.planner.search_space import (
    Limits,
    SearchSpace,
    enumerate_candidates,
    overrides,
)
from fsdp_jax.app.planner.step_time import roofline_constants
from fsdp_jax.errors import SearchError
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.verify.run import devices_for


def search(
    cfg,
    n_devices: int,
    space: SearchSpace,
    limits: Limits,
    *,
    target=None,
    config_name: str = "",
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    """The search document (JSON-able): {"config", "devices", "target", "device_memory",
    "headroom", "budget", "ranked_by", "space", "counts", "candidates" (ranked, every one
    with "overrides", "analytic", "predicted", "compiled" or None, "device_peak" and "free"
    (device memory minus that peak), "status": fits | edge | dropped, "reason"), "dropped" (reason -> count), "winner" (a candidate or None),
    "smallest_fitting_memory" (bytes: the least device memory any candidate would fit in,
    headroom kept), "lora" (`lora_summary`: None without a `lora:` section; every candidate
    is then the LoRA step), "notes", "wall_s"}. Needs `n_devices` devices in this process (fake
    CPU devices will do) for the analytic pass. Raises SearchError for an empty space or
    an impossible constraint; a search that finds nothing returns winner None."""

    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    _check_space(cfg, space, limits)
    hosts = target.hosts if target is not None else 1
    per_host = target.gpus_per_host if target is not None else min(n_devices, 8)
    if target is not None:
        mesh_for = lambda s: target_mesh_sizes(cfg, s, n_devices, hosts)  # noqa: E731
    else:
        mesh_for = lambda s: mesh_shape(cfg, s, n_devices)  # noqa: E731
    space, nvme_note = _without_nvme(cfg, space, limits, target)
    cands, notes = enumerate_candidates(cfg, n_devices, space, mesh_for)
    notes += nvme_note
    say(f"{len(cands)} candidates; analytic pass (memory model + roofline) ...")
    predict_on, cost_note = ranking_target(target)
    gpu = cost_note is None  # a prediction for the target (a GPU or a TPU chip)
    gpu_target = target is not None and target.platform == "gpu"
    platform = target.platform if target is not None else None
    analytic_pass(
        cfg, n_devices, cands, limits, hosts, per_host, predict_on, devices_for(n_devices), gpu_target, platform
    )
    for c in cands:
        c["overrides"] = overrides(cfg, c)
    _check_host_memory(cands, limits)
    dropped = sum(c["status"] == "dropped" for c in cands)
    say(f"analytic pass: {len(cands) - dropped} kept, {dropped} dropped, {time.perf_counter() - t0:.1f} s")
    compiled_n = compile_rounds(cfg, n_devices, cands, limits, target, gpu, say)
    notes += _closing_notes(space, limits, cost_note, gpu_target, predict_on)
    if (dtype := unscaled_experts(cfg, *target_platform(predict_on))) is not None:  # as costed: docs/fp8.md
        notes.append(unscaled_experts_line(cfg, dtype, unscaled_kernels(dtype, target_platform(predict_on)[0])))
    return {
        "config": config_name,
        "devices": n_devices,
        "target": None if target is None else target.as_dict(),
        "device_memory": limits.device_memory,
        "headroom": limits.headroom_bytes,
        "budget": limits.budget,
        "ranked_by": (
            f"predicted tokens/s per {'chip' if target.platform == 'tpu' else 'GPU'}"
            if gpu
            else "analytic cost (no GPU/TPU prediction)"
        ),
        "space": {
            "strategies": list(space.strategies),
            "remats": list(space.remats),
            "microbatches": None if space.microbatches is None else list(space.microbatches),
            "offloads": list(space.offloads),
            "vary": list(space.vary),
            "attentions": list(space.attentions) or [cfg.model.attention],
        },
        "counts": {
            "candidates": len(cands),
            "compiled": compiled_n,
            "fits": sum(c["status"] == "fits" for c in cands),
            "dropped": sum(c["status"] == "dropped" for c in cands),
        },
        **_outcome(cands, limits),
        "lora": lora_summary(cfg),
        "notes": notes,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _closing_notes(space: SearchSpace, limits: Limits, cost_note, gpu_target: bool, predict_on) -> list[str]:
    """The notes after the rounds: how candidates were costed, offload, nvme's disk I/O."""
    notes = [cost_note] if cost_note else []
    notes.append(_offload_note(gpu_target, predict_on))
    if any(nvme_plan.is_nvme(o) for o in space.offloads):
        bps, source = nvme_plan.disk_bytes_per_s(predict_on, limits.disk_bytes_per_s)
        notes.append(
            f"nvme candidates: host/host is their pinned I/O buffers ({nvme_plan.HOST_BUFFERS} layers); the "
            f"update's disk I/O at {bps / 1e9:.1f} GB/s per host ({source}) is added to their step, not hidden "
            "(fsdp_jax.app.planner.nvme_plan)"
        )
    return notes


def lora_summary(cfg) -> dict[str, Any] | None:
    """What a config with a `lora:` section plans (None without one): the trainer's LoRA step,
    adapters trained (with optimizer state for them only), the base frozen at its dtype."""

    spec = spec_from_config(cfg.lora)
    if spec is None:
        return None
    extra = {} if cfg.lora.target_parameters == "auto" else {"target_parameters": cfg.lora.target_parameters}
    if spec.base_quant is not None:  # QLoRA: the targets' frozen weights stored as codes (docs/qlora.md)
        extra |= {
            "base_quant": cfg.lora.base_quant,
            "quant_block": cfg.lora.quant_block,
            "double_quant": cfg.lora.double_quant,
            "base_quant_label": spec.base_quant.label,
        }
    return extra | {
        "rank": spec.rank,
        "alpha": spec.alpha,
        "rslora": spec.rslora,
        "dropout": spec.dropout,
        "targets": cfg.lora.targets,
        "adapter_params": adapter_param_count(cfg.model, spec),
        "base_dtype": np.dtype(Policy.parse(cfg.precision).frozen_storage_dtype).name,
    }


def _outcome(cands: list[dict], limits: Limits) -> dict[str, Any]:
    """The search document's verdict: "candidates" ranked (each given its "rank",
    "device_peak" and "free"), "dropped" (reason -> count, over those that do not fit),
    "winner" and "smallest_fitting_memory"."""
    ranked = rank(cands)
    for i, c in enumerate(ranked):
        c["rank"] = i + 1
        c["device_peak"] = device_peak(c)  # compiled when compiled, else analytic
        c["free"] = limits.device_memory - c["device_peak"]  # what it leaves of the device memory
    # the best verified fit (any fit with --max-compiles 0); without one, the best analytic fit
    fits = [c for c in ranked if c["status"] == "fits"]
    winner = next((c for c in fits if verified(c) or limits.max_compiles == 0), fits[0] if fits else None)
    measured = [c for c in cands if c["reason"] != "host memory over --host-memory"]
    smallest = min((device_peak(c) for c in measured), default=None)
    counts: dict[str, int] = {}
    for c in cands:
        if c["status"] != "fits":
            counts[c["reason"]] = counts.get(c["reason"], 0) + 1
    return {
        "candidates": ranked,
        "dropped": counts,
        "winner": winner,
        "smallest_fitting_memory": None if smallest is None else limits.memory_for(smallest),
    }


def _check_host_memory(cands: list[dict], limits: Limits) -> None:
    """SearchError when every candidate is over the host memory (`--host-memory`)."""
    host = [c["analytic"]["host_per_host"] for c in cands if c["reason"] == "host memory over --host-memory"]
    if len(host) == len(cands):
        raise SearchError(
            f"--host-memory: {limits.host_memory / 1e9:.2f} GB per host is less than every candidate "
            f"needs (at least {min(host) / 1e9:.2f} GB); allow more, or add --offload none"
        )


def _without_nvme(cfg, space: SearchSpace, limits: Limits, target) -> tuple[SearchSpace, list[str]]:
    """`space` without its nvme offloads where `nvme_plan.search_refusal` says why (the note)."""
    nvme = [o for o in space.offloads if nvme_plan.is_nvme(o)]
    why = nvme and nvme_plan.search_refusal(cfg, ranking_target(target)[0], limits.disk_bytes_per_s)
    if not why:
        return space, []
    rest = tuple(o for o in space.offloads if o not in nvme)
    if not rest:
        raise SearchError(f"--offload: {', '.join(nvme)} cannot be searched here: {why}")
    return dataclasses.replace(space, offloads=rest), [f"offload {', '.join(nvme)} left out: {why}"]


def _offload_note(gpu_target: bool, predict_on: str) -> str:
    """The search document's note on how offload candidates were judged and what their
    step counts."""
    return (
        (
            "offload candidates compile for the GPU target without offload, their device side planned "
            "from that compile (fsdp_jax.app.planner.target_offload)"
            if gpu_target
            else "offload candidates are judged by the analytic model only"
        )
        + f"; host<->device transfers at {roofline_constants(predict_on)['host'] / 1e9:.0f} GB/s per device "
        f"({predict_on}'s host link, fsdp_jax/targets/perf_tables.json) are added "
        "to their step, not hidden"
    )


def _check_space(cfg, space: SearchSpace, limits: Limits) -> None:
    """SearchError for an empty space or an impossible headroom; PlanError for a remat
    policy without a record."""
    if limits.budget <= 0:
        raise SearchError(
            f"--headroom: {limits.headroom_bytes / 1e9:.2f} GB leaves nothing of the "
            f"{limits.device_memory / 1e9:.2f} GB device memory"
        )
    for r in space.remats:
        rematerialised(r)  # PlanError for a policy without a record
    if not (space.strategies and space.remats and space.offloads):
        raise SearchError("--search: the search space is empty (a strategy, remat and offload list is needed)")
