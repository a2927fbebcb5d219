"""Will it fit? Per-device memory of a config under each strategy, analytic and compiled.

    doc = plan_config(cfg, n_devices=8, device_memory=parse_bytes("80GB"))
    print(format_table(doc))

For each strategy the planner builds the train step the trainer builds (the same
model, loss, optimizer, precision, remat and microbatches, from the same builder
functions as `fsdp_jax.app.loop.setup`), but from abstract inputs only
(`ShapeDtypeStruct`s carrying shardings, `fsdp_jax.state.abstract_state`:
`fsdp_jax.app.fit.step_build`), and AOT-compiles it: nothing is allocated, so a 7B or 70B model plans on a laptop.
When this process has fewer than N devices, the compile runs in a child process
with N fake CPU devices (`jax_num_cpu_devices=N`). With a GPU target
(`fsdp_jax.targets.Target`: h100, h200, a100 as hosts x GPUs; v4, v5e, v5p, v6e as TPU
slices) the child compiles with XLA:GPU / XLA:TPU for compile-only devices of that target
instead (deviceless AOT; the CUDA plugin or libtpu is on that child's path only), and the result also carries the per-collective
schedule (`fsdp_jax.hlo`), its communication volume and the GPU-only warnings. The user's side (parsing sizes and
strategy lists, the scripts' start-up, the warnings' wording, the tables and the plot)
is `fsdp_jax.app.fit.report`, whose public names are importable from here too.

Two sets of numbers, kept apart:

* **analytic**: params, optimizer state and batch from the sharding plan (exact
  shard shapes); grads, gathered params and activations from the formulas in
  `fsdp_jax.app.fit.memory_model`.
* **compiled**: `memory_analysis()` of the compiled step (`fsdp_jax.memory.compiled_memory`):
  argument (params + optimizer state + batch), output, alias (donated), temp
  (everything transient: grads, gathered params, activations, optimizer-update
  scratch) and the peak. Grads never appear as arguments; they live in temp.

XLA:CPU upcasts bf16 matmuls and collectives to f32 (DESIGN.md), so with bf16
compute a CPU compile's temp is larger than the same program's on GPU/TPU.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fsdp_jax import axes as ax
from fsdp_jax import rules as rl
from fsdp_jax.app.fit.memory_model import (
    DEVICES_PER_HOST,
    activations_by_remat,
    analytic_memory,
    analytic_vs_compiled,
    argument_bytes,
    compute_copy_bytes,
)
from fsdp_jax.app.fit.report import (  # noqa: F401  (some only re-exported)
    CLASSIC_NAMES,
    COMPILED_OVER_ANALYTIC,
    DEFAULT_REPLICATED_THRESHOLD,
    STRATEGY_ORDER,
    PlanError,
    check_inputs,
    fmt_bytes,
    format_inspection,
    format_table,
    load_planning_config,
    parse_bytes,
    parse_devices,
    parse_strategies,
    plot_plan,
    replicated_threshold_for,
    sharding_warnings,
    use_cpu_devices,
)
from fsdp_jax.app.fit.step_build import build_step, target_mesh_sizes
from fsdp_jax.hlo import collective_schedule, communication, involuntary_rematerializations, schedule_warnings
from fsdp_jax.memory import collective_report, compiled_memory, tree_bytes
from fsdp_jax.offload import OffloadError
from fsdp_jax.precision import Policy

# ----------------------------------------------------------------------------- one strategy

def inspect_compiled(plan, compiled, *, logical_axes=None, analytic_total: int | None = None,
                     compute_dtype="float32", replicated_threshold: int | None = None) -> dict[str, Any]:
    """Rows, collectives, compiled memory and warnings for any compiled train step.

    `plan`: the ShardingPlan the step was made with; `compiled`: `step.lower(...).compile()`;
    `logical_axes`: the params' logical names (their `layers` dim marks the scanned
    stack, which enables the hoisted-gather check); `analytic_total`: an estimate to
    hold the compiled peak against. Works for any model: nothing here is Llama-specific.
    """
    mem = compiled_memory(compiled)
    report = collective_report(compiled.as_text())
    mesh = {k: int(v) for k, v in plan.mesh.shape.items()}
    abstract = jax.tree.unflatten(jax.tree.structure(plan.params),
                                  [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in plan.rows])
    layer_gather = None
    if logical_axes is not None:
        # outside the layer loop only unstacked params (embedding, head) should be gathered,
        # in whatever dtype the program moves them (f32 on CPU even under bf16 compute)
        layer_gather = compute_copy_bytes(abstract, plan, logical_axes, "float32")["unstacked"]
    platform = plan.mesh.devices.flat[0].platform
    from fsdp_jax.targets import dcn_groups
    hosts = dcn_groups(list(plan.mesh.devices.flat))  # partition id -> host (GPU) or slice (TPU)
    schedule = collective_schedule(compiled.as_text(), hosts)
    threshold = replicated_threshold_for(sum(r.total_bytes for r in plan.rows), replicated_threshold)
    warnings = sharding_warnings(
        plan.rows, report, plan.strategy.name, mesh, analytic_total=analytic_total,
        compiled_peak=mem["peak"], layer_gather_bytes=layer_gather,
        cpu_upcast=platform == "cpu" and np.dtype(compute_dtype) != np.float32,
        replicated_threshold=threshold)
    if platform != "cpu":  # XLA:CPU never reduce-scatters, upcasts bf16 and runs collectives in sync
        grad_axes = [a for a in plan.strategy.grads if mesh.get(a, 1) > 1]
        # batch axes the grads stay replicated over (HSDP's data axis): all-reduced by design
        replicated = int(np.prod([mesh.get(a, 1) for a in (ax.DATA, ax.FSDP) if a not in plan.strategy.grads]))
        warnings += schedule_warnings(
            schedule, compute_dtype=np.dtype(compute_dtype).name, shards_grads=bool(grad_axes),
            param_bytes_threshold=_param_sized(plan), replicated_group=replicated)
    return {"mesh": mesh, "platform": platform, "rows": [r.as_dict() for r in plan.rows],
            "collectives": report, "compiled": mem, "warnings": warnings,
            "replicated_threshold": threshold, "schedule": schedule}


def _param_sized(plan) -> int:
    """From how many bytes a collective counts as moving parameters / their grads: half
    the smallest sharded leaf (per layer when stacked: 3 or more dims), at least 4 KiB,
    so that norm scales and loss scalars never count."""
    axes_ = set(plan.strategy.params + plan.strategy.opt_state)
    sharded = [r for r in plan.rows if axes_ & set(jax.tree.leaves(tuple(r.spec)))]
    sizes = [r.total_bytes // (r.shape[0] if len(r.shape) > 2 else 1) for r in sharded]
    return max(1 << 12, min(sizes, default=1 << 21) // 2)


def plan_strategy(cfg, strategy: str, devices: Sequence[jax.Device] | None = None, *,
                  inspect: bool = False, replicated_threshold: int | None = None,
                  mesh_sizes: tuple[int, int, int] | None = None,
                  step_options: dict[str, Any] | None = None,
                  compiler_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build, analyse and AOT-compile one strategy in this process (needs the devices:
    real, fake CPU, or compile-only GPU-target devices from `fsdp_jax.targets`).
    Returns a JSON-able dict: mesh, analytic, compiled, argument_vs_analytic, compile_s,
    collectives_per_step, activations_by_remat, replicated_fraction, warnings; with
    `inspect`, also rows, the full collective report and the per-collective `schedule`
    (`fsdp_jax.hlo.collective_schedule`)."""
    t0 = time.perf_counter()
    try:
        b = build_step(cfg, strategy, devices, mesh_sizes, **(step_options or {}))
    except OffloadError:
        if not devices or devices[0].platform != "gpu":
            raise  # compile-only GPU devices: no host memory kind (fsdp_jax.app.fit.target_offload)
        from fsdp_jax.app.fit.target_offload import plan_without_host_memory
        return plan_without_host_memory(
            plan_strategy, cfg, strategy, devices, devices[0].device_kind, inspect=inspect,
            replicated_threshold=replicated_threshold, mesh_sizes=mesh_sizes, step_options=step_options,
            compiler_options=compiler_options)
    analytic = analytic_memory(b)
    try:
        compiled = b.compile(compiler_options)
    except Exception as e:  # XLA:TPU refuses a program that cannot fit its HBM
        refused = over_memory(e)
        if refused is None:
            raise
        return _refused_result(b, cfg, analytic, refused, time.perf_counter() - t0)
    compile_s = time.perf_counter() - t0
    if b.mesh.devices.flat[0].platform == "tpu":  # XLA:TPU pads every argument to its layout's tiles
        from fsdp_jax.tpu_targets import tile_padding
        analytic["tile_padding"] = tile_padding((b.state, b.batch), compiled)
        analytic["total"] += analytic["tile_padding"]
    ins = inspect_compiled(b.plan, compiled, logical_axes=b.model.logical_axes,
                           analytic_total=analytic["total"],
                           compute_dtype=Policy.parse(cfg.precision).compute_dtype,
                           replicated_threshold=replicated_threshold)
    mem = ins["compiled"]
    mem.update(_compiled_host(compiled, mem))
    out: dict[str, Any] = {
        "mesh": ins["mesh"], "analytic": analytic,
        "compiled": {k: mem[k] for k in ("argument", "output", "alias", "temp", "peak", "xla_peak",
                                          "device_argument", "host_argument", "device_peak",
                                          "host_reported")},
        "offload": cfg.offload,
        "argument_vs_analytic": mem["argument"] / argument_bytes(analytic) - 1,
        "compile_s": round(compile_s, 2), "platform": ins["platform"],
        "collectives_per_step": ins["collectives"]["per_step"],
        "communication": communication(ins["schedule"]),
        "activations_by_remat": activations_by_remat(b),
        "warnings": ins["warnings"],
    }
    try:
        out["replicated_fraction"] = rl.check_sufficiently_sharded(
            b.plan.rows, b.plan.strategy.params, b.mesh, cfg.mesh.max_replicated_fraction,
            cfg.mesh.min_replicated_bytes)
    except rl.ShardingError as e:
        out["replicated_fraction"] = None
        out["warnings"].insert(0, f"the trainer would refuse this plan: {e}")
    if inspect:
        out["rows"] = ins["rows"]
        out["collectives"] = ins["collectives"]
        out["replicated_threshold"] = ins["replicated_threshold"]
        out["schedule"] = ins["schedule"]
    return out


_OOM = re.compile(r"RESOURCE_EXHAUSTED: Ran out of memory in memory space (\w+)|"
                  r"RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
                  r"temporaries \(([\d.]+)([KMGTP]?)\) exceeds available HBM \(([\d.]+)([KMGTP]?)\)")


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


def _refused_result(b, cfg, analytic: dict[str, int], refused: dict[str, int], compile_s: float) -> dict[str, Any]:
    """A strategy the target's compiler refused for memory: the argument bytes from the plan
    (equal to the compiled ones wherever a compile succeeds), the temporaries XLA said it
    needs, and no schedule."""
    argument = analytic["params"] + analytic["optimizer"] + analytic["batch"]
    peak = argument + refused["temp"]
    mesh = {k: int(v) for k, v in b.plan.mesh.shape.items()}
    return {
        "mesh": mesh, "analytic": analytic,
        "compiled": {"argument": argument, "output": 0, "alias": 0, "temp": refused["temp"], "peak": peak,
                     "xla_peak": None, "device_argument": argument, "host_argument": 0,
                     "device_peak": peak, "host_reported": 0},
        "refused": refused, "offload": cfg.offload, "argument_vs_analytic": 0.0,
        "compile_s": round(compile_s, 2), "platform": b.plan.mesh.devices.flat[0].platform,
        "collectives_per_step": {}, "communication": {}, "activations_by_remat": activations_by_remat(b),
        "replicated_fraction": None,
        "warnings": [f"the compiler refused this program: its temporaries need {refused['temp'] / 1e9:.2f} GB "
                     f"and the chip offers {refused['available'] / 1e9:.2f} GB, so it does not fit; "
                     f"compiled argument/peak are the plan's argument bytes + those temporaries"],
    }


def _compiled_host(compiled, mem: dict[str, int]) -> dict[str, int]:
    """Host/device split of a compiled step's memory: `device_argument` / `host_argument`
    from the parameter layouts of the compiled program (host-resident = memory space
    S(5)); `host_reported`: memory_analysis()'s host bytes (argument + temp + output -
    alias; 0 where the backend does not report them, e.g. CPU); `device_peak`: the peak
    without host-resident bytes (on such backends, the peak minus the host arguments)."""
    from fsdp_jax.offload import entry_argument_bytes
    ma = compiled.memory_analysis()
    host = {k: int(getattr(ma, f"host_{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "alias", "temp")}
    reported = host["argument"] + host["output"] - host["alias"] + host["temp"]
    entry = entry_argument_bytes(compiled.as_text())
    device_peak = mem["peak"] if reported else mem["peak"] - entry["host"]
    return {"device_argument": entry["device"], "host_argument": entry["host"],
            "host_reported": reported, "device_peak": device_peak}


# ----------------------------------------------------------------------------- many strategies, any N


def run_strategies(cfg, n_devices: int, strategies: Sequence[str], *, inspect: bool = False,
                   replicated_threshold: int | None = None, target=None,
                   step_options: dict[str, Any] | None = None,
                   compiler_options: dict[str, Any] | None = None) -> dict[str, dict]:
    """`plan_strategy` for each strategy on `n_devices`: in this process when it has
    that many devices, otherwise in a child process with `n_devices` fake CPU devices.
    With `target` (a `fsdp_jax.targets.Target`), always in a child process that
    compiles for that GPU target (the CUDA plugin on its path only: `targets.child_env`)."""
    from fsdp_jax.verify import devices_for
    devices = None if target is not None else devices_for(n_devices)
    if devices is not None:
        return {s: plan_strategy(cfg, s, devices, inspect=inspect, replicated_threshold=replicated_threshold,
                                 step_options=step_options, compiler_options=compiler_options)
                for s in strategies}
    from fsdp_jax.app.config import config_to_dict
    request = {"config": config_to_dict(cfg), "devices": n_devices, "strategies": list(strategies),
               "inspect": inspect, "replicated_threshold": replicated_threshold,
               "step_options": step_options or {}, "compiler_options": compiler_options or {}}
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    where = f"{n_devices} CPU devices"
    scratch_dir = (tempfile.TemporaryDirectory(prefix="fsdp_jax-plan-") if target is not None
                   else contextlib.nullcontext())
    with scratch_dir as scratch:
        if target is not None:
            from fsdp_jax import targets
            # raises PluginMissing (a TargetError) naming the install step; the strategies
            # compiled in the child reuse each other's GPU kernels (a cache of its own)
            env = targets.child_env(env, kernel_cache=Path(scratch) / "xla_gpu_kernels.bin", target=target)
            request["target"] = target.as_dict()
            where = target.describe()
        proc = subprocess.run([sys.executable, "-m", "fsdp_jax.app.fit.estimate"], input=json.dumps(request),
                              capture_output=True, text=True, env=env)
    if proc.returncode == 2:
        raise PlanError(proc.stderr.strip().splitlines()[-1].removeprefix("error: "))
    from fsdp_jax.xla_flags import UNKNOWN_FLAG, unknown_flag
    unknown = unknown_flag(proc.stderr)
    if unknown:  # XLA aborts the child on a flag this jaxlib does not know: the user's input
        raise PlanError(f"XLA_FLAGS: {UNKNOWN_FLAG}: {unknown} (this jax's XLA does not know it)")
    if proc.returncode != 0:
        raise RuntimeError(f"planner child process ({where}) failed with exit code "
                           f"{proc.returncode}:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout)
    for name, log in _logs_by_strategy(proc.stderr).items():
        for r in involuntary_rematerializations(log):
            if name in out:
                out[name]["warnings"].append(
                    f"involuntary full rematerialization of {r['tensor']} {r['shape']} (op {r['op_name'] or '?'}): "
                    f"the partitioner could not go from sharding {r['from']} to {r['to']} without "
                    f"materialising the whole tensor on every device; constrain it (or its producer) "
                    f"to a layout that maps onto the target one")
    return out


_STRATEGY_MARK = "fsdp_jax.app.fit.estimate: compiling "


def _logs_by_strategy(stderr: str) -> dict[str, str]:
    """The child's stderr (XLA's own log lines included) cut at the marker printed
    before each strategy's compile."""
    out: dict[str, list[str]] = {}
    current = None
    for line in stderr.splitlines():
        if line.startswith(_STRATEGY_MARK):
            current = line[len(_STRATEGY_MARK):].strip()
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def _child_main() -> int:
    """`python -m fsdp_jax.app.fit.estimate` < request.json: compile on N fake CPU devices
    (or, with "target", on compile-only GPU devices), print the results as JSON. Set
    up before JAX initialises its backends."""
    req = json.loads(sys.stdin.read())
    target = req.get("target")
    if target is None:
        use_cpu_devices(int(req["devices"]))
    from fsdp_jax import targets
    from fsdp_jax.app.cli import BAD_INPUT, fail
    from fsdp_jax.app.config import config_from_dict
    from fsdp_jax.targets import TargetError
    try:
        cfg = config_from_dict(req["config"])
        sizes = {}
        if target is None:
            devices = jax.devices()[:req["devices"]]
        else:
            from fsdp_jax import targets
            t = targets.Target(**target)
            devices = targets.target_devices(t)
            sizes = {s: target_mesh_sizes(cfg, s, len(devices), t.hosts) for s in req["strategies"]}
        out = {}
        for s in req["strategies"]:
            print(_STRATEGY_MARK + s, file=sys.stderr, flush=True)  # XLA logs to the same fd 2
            out[s] = plan_strategy(cfg, s, devices, inspect=req["inspect"],
                                   replicated_threshold=req["replicated_threshold"],
                                   mesh_sizes=sizes.get(s), step_options=req.get("step_options"),
                                   compiler_options=req.get("compiler_options"))
            sys.stderr.flush()
    except BAD_INPUT + (PlanError, TargetError) as e:
        return fail(e)
    except OffloadError as e:  # compile-only GPU devices plan it (target_offload); others refuse
        if target is None:
            raise
        return fail(TargetError(
            f"{e} (compile-only {target['name']} devices offer no pinned_host memory kind: plan --offload "
            f"without --target)"))
    except RuntimeError as e:
        if target is None or "cuDNN" not in str(e):
            raise
        return fail(TargetError(
            f"model.attention=cudnn: NVIDIA's cuDNN library is not in the compile folder ({e}); install it with "
            f"`{targets.INSTALL_HINT}` (it adds NVIDIA's cuDNN wheel next to the CUDA plugin)"))
    json.dump(out, sys.stdout)
    return 0


def plan_config(cfg, n_devices: int, strategies: Sequence[str] | str | None = None, *,
                device_memory: int | None = None, config_name: str = "", target=None) -> dict[str, Any]:
    """The planner's JSON document for `cfg` on `n_devices` (bytes per device, ints):
    {"config", "devices", "params", "param_bytes", "device_memory", "wall_s", "notes",
    "target", "strategies": {name: {"mesh", "analytic": {params, grads, optimizer,
    gathered, activations, batch, states, total}, "compiled": {argument, output, alias,
    temp, peak, xla_peak}, "terms": {argument, temp, peak: compiled / analytic - 1},
    "fits", "headroom", "bytes_per_param", "compile_s", "warnings", ...}}}.
    `fits` and `headroom` use the compiled peak (None without `device_memory`). With
    `target` (`fsdp_jax.targets.Target`) the step is compiled by XLA:GPU for that GPU
    and cluster shape (deviceless), and `device_memory` defaults to the target's."""
    from fsdp_jax.app.models.llama import count_params
    t0 = time.perf_counter()
    names = parse_strategies(strategies)
    check_inputs(cfg, n_devices, names)
    if target is not None and device_memory is None:
        from fsdp_jax.targets import device_memory as target_memory
        device_memory = target_memory(target.name)
    results = run_strategies(cfg, n_devices, names, target=target)
    n_params = count_params(cfg.model)
    policy = Policy.parse(cfg.precision)
    for name, r in results.items():
        r["classic_name"] = CLASSIC_NAMES[name]
        r["bytes_per_param"] = round(r["analytic"]["states"] / n_params, 3)  # per device
        r["terms"] = analytic_vs_compiled(r["analytic"], r["compiled"])
        if device_memory:  # device_peak / device_total: without host-resident (offloaded) bytes
            r["fits"] = r["compiled"]["device_peak"] <= device_memory
            r["headroom"] = device_memory - r["compiled"]["device_peak"]
            r["fits_analytic"] = r["analytic"]["device_total"] <= device_memory
        else:
            r["fits"] = r["headroom"] = r["fits_analytic"] = None
        if target is not None and not r.get("refused"):  # a roofline over its traffic (GPU or TPU)
            from fsdp_jax.app.fit.step_time import predict
            r["predicted"] = predict(cfg, target.name, n_devices, r)
    notes = [f"{n_devices} devices; precision {policy}; remat {cfg.remat}; offload {cfg.offload}; "
             f"global_batch {cfg.train.global_batch} x seq {cfg.data.seq_len}, "
             f"microbatches {cfg.train.microbatches}",
             "analytic params/optimizer/batch come from the sharding plan; grads, gathered and "
             "activations from formulas (fsdp_jax.app.fit.memory_model docstring); compiled = memory_analysis() "
             "of the AOT-compiled train step (grads live in its temp)"]
    if cfg.offload != "none":
        notes.append(f"offload {cfg.offload}: host = per-device bytes resting in pinned host memory "
                     f"(x{DEVICES_PER_HOST} per host); fits uses device_peak / device_total, which "
                     "leave them out (on CPU the compiled program moves nothing, so its device_peak "
                     "misses the transient device copies the analytic device_total counts)")
    if "hybrid_shard" in results:
        m = results["hybrid_shard"]["mesh"]
        notes.append(f"hybrid_shard uses data={m['data']} x fsdp={m['fsdp']} (params sharded within "
                     f"fsdp, replicated over data)")
    if target is not None:
        notes.insert(0, f"compiled by XLA:{target.platform.upper()} for {target.describe()} (deviceless AOT: "
                        f"no {target.platform.upper()} used; no autotuning); device memory "
                        f"{device_memory / 1e9:.2f} GB unless given")
    platforms = {r["platform"] for r in results.values()}
    if "cpu" in platforms and policy.compute_dtype != np.dtype("float32"):
        notes.append("compiled on CPU: XLA:CPU upcasts bf16 matmuls and collectives to f32, so "
                     "compiled temp overstates a GPU/TPU compile")
    doc = {"config": config_name, "devices": n_devices, "params": n_params,
           "target": None if target is None else target.as_dict(),
           "param_bytes": tree_bytes(_abstract_params(cfg)), "device_memory": device_memory,
           "strategies": results, "notes": notes}
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    return doc


def format_offload_table(docs: dict[str, dict[str, Any]]) -> str:
    """Strategy x offload setting: device bytes (analytic device_total, compiled
    device_peak), host bytes per device and per host, and whether it fits."""
    first = next(iter(docs.values()))
    mem = first.get("device_memory")
    lines = [f"offload: bytes per device (analytic device_total / compiled device_peak) and host "
             f"bytes (per device / per host of {DEVICES_PER_HOST})"
             + (f"; fits = analytic and compiled <= {fmt_bytes(mem)}" if mem else "")]
    hdr = (f"{'strategy':<14}{'offload':<18}{'device ana':>11}{'device cmp':>11}{'host/dev':>10}"
           f"{'host/host':>11}{'H<->D/step':>11}{'fits':>9}")
    lines += [hdr, "-" * len(hdr)]
    for name in first["strategies"]:
        for off, doc in docs.items():
            r = doc["strategies"][name]
            a, c = r["analytic"], r["compiled"]
            fits = "-" if r["fits"] is None else (
                f"{'yes' if r['fits_analytic'] else 'NO'}/{'yes' if r['fits'] else 'NO'}")
            lines.append(f"{name:<14}{off:<18}{fmt_bytes(a['device_total']):>11}"
                         f"{fmt_bytes(c['device_peak']):>11}{fmt_bytes(a['host']):>10}"
                         f"{fmt_bytes(a['host_per_host']):>11}{fmt_bytes(a['transfer_per_step']):>11}"
                         f"{fits:>9}")
    if mem and "none" in docs:
        only = [n for n in first["strategies"]
                if not docs["none"]["strategies"][n]["fits_analytic"]
                and any(d["strategies"][n]["fits_analytic"] for o, d in docs.items() if o != "none")]
        lines.append("fits only with offload (analytic): " + (", ".join(only) or "none"))
    return "\n".join(lines)


def _abstract_params(cfg):
    """The master params as the trainer stores them (in the precision's param dtype)."""
    from fsdp_jax.adapters import from_nnx
    from fsdp_jax.app.models.llama import Llama
    from fsdp_jax.build import with_param_dtype
    model = from_nnx(lambda rngs: Llama(cfg.model, rngs=rngs))
    return with_param_dtype(model, Policy.parse(cfg.precision).param_dtype).abstract_params


if __name__ == "__main__":
    sys.exit(_child_main())
