"""Will it fit? Per-device memory of a config under each strategy, analytic and compiled.

    doc = plan_config(cfg, n_devices=8, device_memory=parse_bytes("80GB"))
    print(format_table(doc))

For each strategy the planner builds the train step the trainer builds (the same
model, loss, optimizer, precision, remat and microbatches, from the same builder
functions as `fsdp_jax.app.trainer.loop.setup`), but from abstract inputs only
(`ShapeDtypeStruct`s carrying shardings, `fsdp_jax.train.state.abstract_state`:
`fsdp_jax.app.planner.abstract_step`), and AOT-compiles it: nothing is allocated, so a 7B or 70B model plans on a laptop.
When this process has fewer than N devices, the compile runs in a child process
with N fake CPU devices (`jax_num_cpu_devices=N`). With a GPU target
(`fsdp_jax.targets.gpu.Target`: h100, h200, a100, rtx4090, rtx3090, l4, l40s, a10g as hosts x GPUs; v4, v5e, v5p, v6e as TPU
slices) the child compiles with XLA:GPU / XLA:TPU for compile-only devices of that target
instead (deviceless AOT; the CUDA plugin or libtpu is on that child's path only), and the result also carries the per-collective
schedule (`fsdp_jax.hlo.schedule`), its communication volume and the GPU-only warnings. The user's side (parsing sizes and
strategy lists, the scripts' start-up, the warnings' wording, the tables and the plot)
is `fsdp_jax.app.planner.report`, whose public names are importable from here too.
One strategy in this process is `fsdp_jax.app.planner.one_strategy.plan_strategy` (what the
compiled step holds: `inspection`; a compiler's refusal for memory: `refusal`); many,
in a child process when needed, `fsdp_jax.app.planner.compile_child.run_strategies`. Their
names are importable from here too, and `python -m fsdp_jax.app.planner.estimate` is the child.

Two sets of numbers, kept apart:

* **analytic**: params, optimizer state and batch from the sharding plan (exact
  shard shapes); grads, gathered params and activations from the formulas in
  `fsdp_jax.app.planner.memory_model`.
* **compiled**: `memory_analysis()` of the compiled step (`fsdp_jax.hlo.memory.compiled_memory`):
  argument (params + optimizer state + batch), output, alias (donated), temp
  (everything transient: grads, gathered params, activations, optimizer-update
  scratch) and the peak. Grads never appear as arguments; they live in temp.

XLA:CPU upcasts bf16 matmuls and collectives to f32 (docs/design.md), so with bf16
compute a CPU compile's temp is larger than the same program's on GPU/TPU.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from fsdp_jax.app.config.fp8_checks import target_platform, unscaled_experts, unscaled_experts_line, unscaled_kernels
from fsdp_jax.app.host_memory import HOST_MEMORY_ENV, fmt_size
from fsdp_jax.app.models.decoder import count_params
from fsdp_jax.app.objectives.grpo_run import check_grpo_config, is_grpo
from fsdp_jax.app.planner import nvme_plan
from fsdp_jax.app.planner.compile_child import (
    child_main,
    run_strategies,
)
from fsdp_jax.app.planner.flag_values import parse_strategies
from fsdp_jax.app.planner.grpo_plan import grpo_split, row_cfg
from fsdp_jax.app.planner.inputs import CLASSIC_NAMES, check_inputs
from fsdp_jax.app.planner.memory_model import DEVICES_PER_HOST, analytic_vs_compiled
from fsdp_jax.app.planner.report import fmt_bytes
from fsdp_jax.app.planner.search_prediction import analytic_communication
from fsdp_jax.app.planner.step_time import predict, predict_roofline
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.hlo.memory import tree_bytes
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.targets import gpu
from fsdp_jax.train.build import with_param_dtype


def plan_config(
    cfg,
    n_devices: int,
    strategies: Sequence[str] | str | None = None,
    *,
    device_memory: int | None = None,
    config_name: str = "",
    target=None,
    host_memory: tuple[int, str] | None = None,
    disk_bytes_per_s: float | None = None,
) -> dict[str, Any]:
    """The planner's JSON document for `cfg` on `n_devices` (bytes per device, ints):
    {"config", "devices", "params", "param_bytes", "device_memory", "wall_s", "notes", "fp8" (`fp8_part`),
    "target", "strategies": {name: {"mesh", "analytic": {params, grads, optimizer,
    gathered, activations, batch, states, total}, "compiled": {argument, output, alias,
    temp, peak, xla_peak}, "terms": {argument, temp, peak: compiled / analytic - 1},
    "fits", "headroom", "bytes_per_param", "compile_s", "warnings", ...}}}.
    `fits` and `headroom` use the compiled peak (None without `device_memory`). With
    `target` (`fsdp_jax.targets.gpu.Target`) the step is compiled by XLA:GPU for that GPU
    and cluster shape (deviceless), and `device_memory` defaults to the target's.
    `host_memory` (bytes per host, where the figure comes from): with an offload, each
    strategy's `fits_host` (its offloaded state per host within it; `fits` False when not)
    and a note naming the strategies over it. `disk_bytes_per_s`: a host's local-disk
    bandwidth for an nvme offload's step time (None: the target's, `nvme_plan`)."""

    t0 = time.perf_counter()
    names = parse_strategies(strategies)
    if is_grpo(cfg):  # what GRPO refuses, as the trainer; rows of prompt + completion tokens
        check_grpo_config(cfg, 1 if target is None else target.hosts)
        cfg = row_cfg(cfg)
    check_inputs(cfg, n_devices, names)
    if target is not None and device_memory is None:
        device_memory = gpu.device_memory(target.name)
    results = run_strategies(cfg, n_devices, names, target=target)
    n_params = count_params(cfg.model)
    policy = Policy.parse(cfg.precision)
    for name, r in results.items():
        r["classic_name"] = CLASSIC_NAMES[name]
        r["bytes_per_param"] = round(r["analytic"]["states"] / n_params, 3)  # per device
        r["terms"] = analytic_vs_compiled(r["analytic"], r["compiled"])
        peak = r["compiled"]["device_peak"]
        if "grpo" in r:  # a GRPO step peaks in its generation or its training
            peak = r["grpo"]["step_peak"] = max(peak, r["grpo"]["peak"])
        if device_memory:  # device_peak / device_total: without host-resident (offloaded) bytes
            r["fits"] = peak <= device_memory
            r["headroom"] = device_memory - peak
            r["fits_analytic"] = r["analytic"]["device_total"] <= device_memory
        else:
            r["fits"] = r["headroom"] = r["fits_analytic"] = None
        if target is not None:  # op by op from its program (GPU or TPU), or a roofline
            r["predicted"] = _prediction(cfg, target, n_devices, name, r)
            if r["predicted"] and nvme_plan.is_nvme(cfg.offload):  # + the update's disk I/O, not hidden
                nvme_plan.add_io(r["predicted"], r["analytic"], target.table, disk_bytes_per_s)
            if "grpo" in r and r["predicted"]:  # generation + num_iterations training steps
                r["predicted"]["grpo"] = grpo_split(cfg, target.table, r["grpo"], r["predicted"]["step_s"])
    notes = _notes(cfg, n_devices, policy, results, target, device_memory)
    if (fp8 := fp8_part(cfg, target)) and fp8["experts"] and not fp8["experts"]["fp8"]:
        notes.append(unscaled_experts_line(cfg, fp8["experts"]["dtype"], fp8["experts"]["kernels"]))
    notes += _host_notes(cfg, results, host_memory)
    doc = {
        "config": config_name,
        "devices": n_devices,
        "params": n_params,
        "target": None if target is None else target.as_dict(),
        "param_bytes": tree_bytes(_abstract_params(cfg)),
        "device_memory": device_memory,
        "strategies": results,
        "notes": notes,
        "fp8": fp8,
    }
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    return doc


def fp8_part(cfg, target) -> dict[str, Any] | None:
    """The plan's FP8 part (None without `precision ...,matmul=fp8`): the recipe, and for routed
    experts {"kernels": capacity | xla | tokamax, "fp8": whether their products run in FP8,
    "dtype": the dtype they run in} on `target` (None: this host's CPU; `unscaled_experts`; "xla"
    with "fp8" false: XLA's ragged_dot uncast, where tokamax has no kernel for the compute dtype)."""
    if Policy.parse(cfg.precision).matmul != "fp8":
        return None
    experts = None
    if cfg.model.n_experts:
        platform = target_platform(None if target is None else target.table)
        dtype = unscaled_experts(cfg, *platform)
        kernels = "capacity" if cfg.model.capacity_factor else unscaled_kernels(dtype, platform[0]) if dtype else "xla"
        experts = {"kernels": kernels, "fp8": dtype is None, "dtype": dtype or "fp8"}
    return {"recipe": cfg.fp8.recipe, "experts": experts}


def _notes(
    cfg, n_devices: int, policy: Policy, results: dict[str, dict], target, device_memory: int | None
) -> list[str]:
    """The plan document's notes: what was planned and how, and what the figures leave out."""
    notes = [
        f"{n_devices} devices; precision {policy}; remat {cfg.remat}; offload {cfg.offload}; "
        f"global_batch {cfg.train.global_batch} x seq {cfg.data.seq_len}, "
        f"microbatches {cfg.train.microbatches}",
        "analytic params/optimizer/batch come from the sharding plan; grads, gathered and "
        "activations from formulas (fsdp_jax.app.planner.memory_model docstring); compiled = memory_analysis() "
        "of the AOT-compiled train step (grads live in its temp)",
    ]
    if nvme_plan.is_nvme(cfg.offload):
        notes += nvme_plan.notes(cfg.offload, results)
    elif cfg.offload != "none":
        notes.append(
            f"offload {cfg.offload}: host = per-device bytes resting in pinned host memory "
            f"(x{DEVICES_PER_HOST} per host); fits uses device_peak / device_total, which "
            "leave them out (on CPU the compiled program moves nothing, so its device_peak "
            "misses the transient device copies the analytic device_total counts)"
        )
    if "hybrid_shard" in results:
        m = results["hybrid_shard"]["mesh"]
        notes.append(
            f"hybrid_shard uses data={m['data']} x fsdp={m['fsdp']} (params sharded within fsdp, replicated over data)"
        )
    if target is not None:
        notes.insert(
            0,
            f"compiled by XLA:{target.platform.upper()} for {target.describe()} (deviceless AOT: "
            f"no {target.platform.upper()} used; no autotuning); device memory "
            f"{device_memory / 1e9:.2f} GB unless given",
        )
    platforms = {r["platform"] for r in results.values()}
    if "cpu" in platforms and policy.compute_dtype != np.dtype("float32"):
        notes.append(
            "compiled on CPU: XLA:CPU upcasts bf16 matmuls and collectives to f32, so "
            "compiled temp overstates a GPU/TPU compile"
        )
    return notes


def _host_notes(cfg, results: dict[str, dict], host_memory: tuple[int, str] | None) -> list[str]:
    """With an offload: each strategy's `fits_host` against `host_memory` (None: not
    checked), `fits` turned False where the offloaded state is over it; the note saying so."""

    if cfg.offload == "none":
        return []
    have, source = host_memory if host_memory is not None else (None, "")
    over = []
    for name, r in results.items():
        need = r["analytic"]["host_per_host"]
        r["fits_host"] = None if have is None else need <= have
        if r["fits_host"] is False:
            over.append(f"{name} {fmt_size(need)}")
            r["fits"] = False if r["fits"] is not None else r["fits"]
            r["fits_analytic"] = False if r.get("fits_analytic") is not None else r.get("fits_analytic")
    if have is None:
        return [f"host memory per host not checked (give --host-memory, or set {HOST_MEMORY_ENV}=SIZE)"]
    if not over:
        return [f"offloaded state per host fits in {fmt_size(have)} of host memory ({source})"]
    return [f"host memory {fmt_size(have)} ({source}) is less than the offloaded state per host of: " + ", ".join(over)]


def format_offload_table(docs: dict[str, dict[str, Any]]) -> str:
    """Strategy x offload setting: device bytes (analytic device_total, compiled
    device_peak), host bytes per device and per host, and whether it fits."""
    first = next(iter(docs.values()))
    mem = first.get("device_memory")
    lines = [
        f"offload: bytes per device (analytic device_total / compiled device_peak) and host "
        f"bytes (per device / per host of {DEVICES_PER_HOST}; an nvme offload's: its I/O buffers, and its files "
        "on disk per host)" + (f"; fits = analytic and compiled <= {fmt_bytes(mem)}" if mem else "")
    ]
    hdr = (
        f"{'strategy':<14}{'offload':<18}{'device ana':>11}{'device cmp':>11}{'host/dev':>10}"
        f"{'host/host':>11}{'H<->D/step':>11}{'disk/host':>11}{'fits':>9}"
    )
    lines += [hdr, "-" * len(hdr)]
    for name in first["strategies"]:
        for off, doc in docs.items():
            r = doc["strategies"][name]
            a, c = r["analytic"], r["compiled"]
            fits = (
                "-"
                if r["fits"] is None
                else (f"{'yes' if r['fits_analytic'] else 'NO'}/{'yes' if r['fits'] else 'NO'}")
            )
            lines.append(
                f"{name:<14}{off:<18}{fmt_bytes(a['device_total']):>11}"
                f"{fmt_bytes(c['device_peak']):>11}{fmt_bytes(a['host']):>10}"
                f"{fmt_bytes(a['host_per_host']):>11}{fmt_bytes(a['transfer_per_step']):>11}"
                f"{fmt_bytes(a['disk_per_host']) if 'disk_per_host' in a else '-':>11}{fits:>9}"
            )
    if mem and "none" in docs:
        only = [
            n
            for n in first["strategies"]
            if not docs["none"]["strategies"][n]["fits_analytic"]
            and any(d["strategies"][n]["fits_analytic"] for o, d in docs.items() if o != "none")
        ]
        lines.append("fits only with offload (analytic): " + (", ".join(only) or "none"))
    return "\n".join(lines)


def _abstract_params(cfg):
    """The master params as the trainer stores them (in the precision's param dtype)."""

    model = trainer_model(cfg.model)
    return with_param_dtype(model, Policy.parse(cfg.precision).param_dtype).abstract_params


if __name__ == "__main__":
    sys.exit(child_main())


def _prediction(cfg, target, n_devices: int, strategy: str, r: dict[str, Any]) -> dict[str, Any] | None:
    """The predicted step of one strategy's result: op by op from its compiled program; for a
    program the compiler refused (no program to walk) the roofline over the analytic traffic,
    its `basis` saying so (the plan is marked as not fitting)."""

    if not r.get("refused"):
        return predict(cfg, target.table, n_devices, r)

    m = r["mesh"]
    comm = analytic_communication(cfg, strategy, (m["data"], m["fsdp"], m["tensor"]), target.hosts, target.table)
    p = predict_roofline(cfg, target.table, n_devices, {"analytic": r["analytic"], "communication": comm})
    if p is not None:
        p["basis"] = "roofline over the analytic traffic: the compiler refused the program"
    return p
