"""NVMe offload planned (`offload: optimizer:nvme`, `fsdp_jax.nvme`): the device side from the
step compiled without offload, the host buffers, the disk bytes and the disk time by formula.

The nvme step (`fsdp_jax.nvme.step.NvmeStep`) runs the program of a run without offload with
the stacked optimizer state cut out (it rests in one file per layer), then updates one layer at
a time: layer i+1 read while layer i updates and layer i-1 is written, through
`HOST_BUFFERS` page-aligned host buffers of one layer each. So, per device, with S the stored
(stacked) optimizer state's shard bytes and L the layer count:

    device      = the step without offload - S + 2 S / L   (layer i's state in, its new state out)
    host        = HOST_BUFFERS x S / L                      (the pinned I/O buffers)
    disk        = S                                         (x devices per host: a host's files)
    host<->dev  = 2 S per step                              (each layer's state in and back)
    disk I/O    = 2 S x devices per host per step           (read once, written once)

The update waits for its I/O (it runs after the backward pass, nothing to hide it behind), so
a step takes the compute model's time plus `io_seconds`: the slower of the disk (a host's
read + write bytes over the disk bandwidth: reads and writes share the drives) and the host
link (per device, each way). The disk bandwidth is a target's `disk` entry in
`fsdp_jax/targets/perf_tables.json` (a node's local NVMe, sourced there) or `plan --disk-gbps`.

`optimizer+params:nvme` (planned; the trainer refuses it until its layer-wise driver exists) keeps
P, the stacked f32 master params' shard bytes, in the same files, and feeds the forward and the
backward a layer at a time from them (ZeRO-Infinity's parameter offload): the forward reads
layer i+1 while layer i computes; the backward reads layer i again, runs its vjp and writes its
grads (Gr: the reduce dtype) to files, since global-norm clipping and the non-finite skip need
every grad before any update; then the update streams params, state and grads a layer at a time
as `optimizer:nvme` does. Per device:

    device      = the step without offload - S - P - G + 2 (S + P + G) / L
                  (G: the memory model's grads of those params; the compiled step's peak
                  loses Gr, the grads as it holds them)
    host        = HOST_BUFFERS x (S + P + Gr) / L
    disk        = S + P + Gr
    host<->dev  = 4 P + 2 S + 2 Gr per step        (forward P in; backward P in, Gr out;
                                                     update P, S, Gr in, P, S out)
    disk I/O    = the same bytes x devices per host

The forward's reads overlap the forward's compute and the backward's reads and writes the
backward's; the update's I/O waits, as under `optimizer:nvme`. So a step is max(forward
compute, forward I/O) + max(backward compute, backward I/O) + update I/O, each I/O the slower of
disk and host link, the forward's share of the compute from `FORWARD_SHARE`.
"""

from __future__ import annotations

from typing import Any

import jax

from fsdp_jax.app.objectives.preference_run import is_preference
from fsdp_jax.app.trainer.build import lora_spec
from fsdp_jax.hlo.memory import shard_bytes
from fsdp_jax.nvme import HOST_BUFFERS, LAYERED, NVME_OFFLOADS, PARAMS_NVME, labels_of
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.targets.perf_tables import perf_table

BASIS = "device_side_from_the_step_without_offload_host_and_disk_analytic"


# the forward's share of a step's compute, by FLOPs per token: forward 2N, backward 4N, and with
# `remat: full` the forward once more in the backward (2N of 8N); other policies recompute less
FORWARD_SHARE = {"full": 2 / 8}
FORWARD_SHARE_DEFAULT = 2 / 6


def is_nvme(offload: str | None) -> bool:
    return offload in NVME_OFFLOADS


def _host_bytes(leaves, host) -> int:
    """A host's bytes of `leaves`: each distinct shard its devices hold once (`Layout`)."""
    total = 0
    for x in leaves:
        index = x.sharding.devices_indices_map(x.shape)
        total += len({tuple((s.start, s.stop) for s in index[d]) for d in host}) * shard_bytes(x)
    return total


def stacked_params(build, devices_per_host: int) -> dict[str, int]:
    """What `optimizer+params:nvme` keeps in files besides the optimizer state, of a planner
    `StepBuild`: p / p_host (the stacked params' bytes per device / a host's) and gr / gr_host
    (their grads in the reduce dtype, written in the backward, read by the update; also what the
    compiled step holds of them)."""
    layered = build.plan.layered
    if layered is None:
        return {"p": 0, "p_host": 0, "gr": 0, "gr_host": 0}
    stacked = [x for x, m in zip(jax.tree.leaves(build.state.params), jax.tree.leaves(layered)) if m]
    host = sorted(build.mesh.devices.flat, key=lambda d: d.id)[:devices_per_host]
    reduce = Policy.parse(build.cfg.precision).reduce_dtype
    grads = [jax.ShapeDtypeStruct(x.shape, reduce, sharding=x.sharding) for x in stacked]
    return {
        "p": sum(shard_bytes(x) for x in stacked),
        "p_host": _host_bytes(stacked, host),
        "gr": sum(shard_bytes(x) for x in grads),
        "gr_host": _host_bytes(grads, host),
    }


def stored_bytes(build, devices_per_host: int) -> tuple[int, int, int, int]:
    """(S: per-device bytes of the optimizer state the nvme step keeps in files, a host's bytes
    of it, its largest leaf's bytes on a host, L: layers) of a planner `StepBuild` (built with
    offload none, as the trainer builds an nvme run). A host's files hold each distinct shard
    its devices have once (`Layout`), so a leaf replicated over a host's devices counts once
    there; the host is the first `devices_per_host` devices of the mesh."""
    layered = build.plan.layered
    if layered is None or not any(jax.tree.leaves(layered)):
        return 0, 0, 0, 1
    labels = labels_of(build.optimizer, build.state.opt_state, layered)
    stored = [x for x, m in zip(jax.tree.leaves(build.state.opt_state), jax.tree.leaves(labels)) if m == LAYERED]
    if not stored:
        return 0, 0, 0, 1
    host = sorted(build.mesh.devices.flat, key=lambda d: d.id)[:devices_per_host]
    per_leaf = [_host_bytes([x], host) for x in stored]
    return sum(shard_bytes(x) for x in stored), sum(per_leaf), max(per_leaf), stored[0].shape[0]


def nvme_memory(build, analytic: dict[str, int], devices_per_host: int) -> dict[str, int]:
    """The module docstring's split of `analytic` (the memory model's bytes of the step
    without offload): host (per device: its share of a host's buffers), host_per_host,
    disk, disk_per_host, device_total, transfer_per_step (host<->device bytes per device) and
    disk_per_step (a host's bytes read + written), checkpoint_host_per_host (a host's memory
    for a checkpoint's stacked leaves: `NvmeStep.to_save` streams them layer by layer out of
    the files through two of the step's own buffers, so it is within host_per_host)."""
    s, s_host, _, layers = stored_bytes(build, devices_per_host)
    if build.cfg.offload != PARAMS_NVME:
        layer, layer_host = -(-s // layers), -(-s_host // layers)
        return {
            "host": HOST_BUFFERS * layer_host // devices_per_host,
            "host_per_host": HOST_BUFFERS * layer_host,
            "disk": s,
            "disk_per_host": s_host,
            "device_total": analytic["total"] - s + 2 * layer,
            "transfer_per_step": 2 * s,
            "disk_per_step": 2 * s_host,
            "checkpoint_host_per_host": 2 * layer_host,
        }
    q = stacked_params(build, devices_per_host)
    p, gr = q["p"], q["gr"]
    # the stacked params' share of the memory model's grads (held in one dtype for every leaf)
    g = analytic["grads"] * p // analytic["params"] if analytic["params"] else 0
    files, files_host = s + p + gr, s_host + q["p_host"] + q["gr_host"]
    layer_host = -(-files_host // layers)
    return {
        "host": HOST_BUFFERS * layer_host // devices_per_host,
        "host_per_host": HOST_BUFFERS * layer_host,
        "disk": files,
        "disk_per_host": files_host,
        "disk_params_per_host": q["p_host"],
        "device_total": analytic["total"] - (s + p + g) + 2 * -(-(s + p + g) // layers),
        "off_device": s + p + g,  # what leaves the memory model's total, two layers of it back
        "off_device_compiled": s + p + gr,  # ... and the compiled step's peak (its grads as it holds them)
        "off_arguments": s + p,  # ... and its arguments
        "stored_layers": layers,
        "transfer_per_step": 4 * p + 2 * s + 2 * gr,
        "transfer_forward": p,
        "transfer_backward": p + gr,
        "disk_per_step": 4 * q["p_host"] + 2 * s_host + 2 * q["gr_host"],
        "disk_forward": q["p_host"],
        "disk_backward": q["p_host"] + q["gr_host"],
        "forward_share": FORWARD_SHARE.get(build.cfg.remat, FORWARD_SHARE_DEFAULT),
        "checkpoint_host_per_host": 2 * -(-(s_host + q["p_host"]) // layers),
    }


def rescale_host(a: dict[str, int], per_host: int, devices_per_host: int) -> None:
    """`nvme_memory`'s host terms for a host of `per_host` devices instead of `devices_per_host`."""
    for k in ("disk_per_host", "disk_params_per_host", "disk_per_step", "disk_forward", "disk_backward"):
        if k in a:
            a[k] = a[k] * per_host // devices_per_host


def complete_compiled(r: dict[str, Any]) -> dict[str, Any]:
    """A plan result of the step without offload (`one_strategy.plan_strategy` of an nvme
    config: its analytic terms already carry `nvme_memory`) with its compiled figures split
    the same way: the stored state leaves the argument bytes, two layers of it come back."""
    a, c = r["analytic"], r["compiled"]
    if "off_device_compiled" in a:  # params on disk: the stacked grads leave too, two layers come back
        off = a["off_device_compiled"]
        back = 2 * -(-off // a["stored_layers"])
    else:
        off, back = a["disk"], a["device_total"] - (a["total"] - a["disk"])
    c["host_argument"] = 0
    c["device_argument"] = c["argument"] - a.get("off_arguments", a["disk"])
    c["device_peak"] = c["peak"] - off + back
    c["host_reported"] = 0
    r["offload_basis"] = BASIS
    r["warnings"].insert(0, note(r["offload"]))
    r["warnings"].insert(
        1,
        f"a checkpoint under {r['offload']} streams the stacked state layer by layer out of the files "
        f"(fsdp_jax.nvme.NvmeStep.to_save; restore rebuilds them likewise) through two of the step's "
        f"host buffers: {a['checkpoint_host_per_host'] / 1e9:.2f} GB per host, within its host figure",
    )
    return r


def _stored(offload: str) -> tuple[str, str]:
    """(what rests in the files, what leaves the device) under `offload`, for the notes."""
    if offload == PARAMS_NVME:
        return (
            "the stacked optimizer state and f32 master params (and the backward's grads of them)",
            "that state, those params and their grads (fed and updated a layer at a time by the trainer's layer-wise step)",
        )
    return "the stacked optimizer state", "that state"


def note(offload: str) -> str:
    what, off = _stored(offload)
    return (
        f"offload {offload}: {what} rest in files (disk = their bytes per device, x devices per host); device = "
        f"this step compiled without offload - {off} + two layers of it (the per-layer update's in and out); "
        f"host = {HOST_BUFFERS} layers of pinned I/O buffers (fsdp_jax.app.planner.nvme_plan)"
    )


def disk_bytes_per_s(target_name: str, stated: float | None = None) -> tuple[float, str]:
    """(a host's local-disk bandwidth in bytes/s, where it comes from): `stated` (--disk-gbps)
    or the target's `disk` entry of the step-time table."""
    if stated is not None:
        return stated, "--disk-gbps"
    disk = perf_table(target_name).get("disk")
    if not disk:
        raise ValueError(f"target {target_name!r} states no local-disk bandwidth: give --disk-gbps")
    return disk["bytes_per_s"], f"{target_name} table"


def io_seconds(
    analytic: dict[str, int], host_bytes_per_s: float, disk_bps: float, compute_s: float = 0.0
) -> dict[str, float]:
    """The nvme step's I/O per step: `disk_s` (a host's read + write bytes over the disk),
    `host_s` (a device's bytes over its host link) and `io_s`, what it adds to a step of
    `compute_s`: under `optimizer:nvme` the slower of the two (the pipeline overlaps them and the
    update's own compute, nothing else); with the params on disk what the forward's and the
    backward's I/O leave exposed beyond the compute they overlap, plus the update's (the module
    docstring)."""
    disk_s = analytic.get("disk_per_step", 0) / disk_bps
    host_s = analytic.get("transfer_per_step", 0) / host_bytes_per_s
    if "disk_forward" not in analytic:
        return {"disk_s": disk_s, "host_s": host_s, "io_s": max(disk_s, host_s)}

    def phase(disk_bytes, link_bytes):
        return max(disk_bytes / disk_bps, link_bytes / host_bytes_per_s)

    fwd_io = phase(analytic["disk_forward"], analytic["transfer_forward"])
    bwd_io = phase(analytic["disk_backward"], analytic["transfer_backward"])
    update_io = phase(
        analytic["disk_per_step"] - analytic["disk_forward"] - analytic["disk_backward"],
        analytic["transfer_per_step"] - analytic["transfer_forward"] - analytic["transfer_backward"],
    )
    fwd = analytic["forward_share"] * compute_s
    exposed = max(fwd, fwd_io) + max(compute_s - fwd, bwd_io) + update_io - compute_s
    return {"disk_s": disk_s, "host_s": host_s, "io_s": exposed}


def add_io(p: dict[str, Any], analytic: dict[str, int], target_name: str, stated_disk: float | None) -> dict:
    """A step prediction of the program without offload (`step_time.predict`) with the nvme
    update's `io_seconds` added (not hidden) and its rates scaled to the longer step; the
    disk figures it used under `p["io"]`."""
    bps, source = disk_bytes_per_s(target_name, stated_disk)
    io = io_seconds(analytic, perf_table(target_name)["host"]["bytes_per_s"], bps, p["step_s"])
    step = p["step_s"] + io["io_s"]
    scale = p["step_s"] / step if step else 1.0
    g = lambda x: float(f"{x:.4g}")  # noqa: E731
    p.update(
        step_s=g(step),
        band_s=[g(b + io["io_s"]) for b in p.get("band_s") or (p["step_s"], p["step_s"])],
        tokens_per_s_per_gpu=g(p["tokens_per_s_per_gpu"] * scale),
        tflops_per_gpu=g(p["tflops_per_gpu"] * scale),
        mfu=g(p["mfu"] * scale),
        io={**{k: g(v) for k, v in io.items()}, "disk_bytes_per_s": bps, "disk_source": source},
    )
    return p


def notes(offload: str, results: dict[str, dict[str, Any]]) -> list[str]:
    """The plan's lines for an nvme offload: per strategy, the bytes on disk, in host buffers
    and through the disks per step, and (with a prediction) the I/O seconds it adds."""
    gb = lambda n: f"{n / 1e9:.2f} GB"  # noqa: E731
    what, off = _stored(offload)
    lines = [
        f"offload {offload}: {what} in files on local disks, streamed per layer through {HOST_BUFFERS} pinned "
        f"host buffers of one layer (fsdp_jax.app.planner.nvme_plan); host = those buffers; device = the step "
        f"without offload - {off} + two layers of it"
    ]
    for name, r in results.items():
        a = r["analytic"]
        line = (
            f"{name}: disk {gb(a['disk_per_host'])} per host ({gb(a['disk'])} per device), host buffers "
            f"{gb(a['host_per_host'])} per host, disk I/O {gb(a['disk_per_step'])} per host per step, "
            f"host<->device {gb(a['transfer_per_step'])} per device per step"
        )
        io = (r.get("predicted") or {}).get("io")
        if io:
            waits = "the update waits" if offload != PARAMS_NVME else "the forward and backward wait"
            line += (
                f"; at {io['disk_bytes_per_s'] / 1e9:.1f} GB/s ({io['disk_source']}) {waits} "
                f"{io['io_s']:.2f} s for it (disk {io['disk_s']:.2f} s, host link {io['host_s']:.2f} s), in the step time"
            )
        lines.append(line)
    return lines


def search_refusal(cfg, target_name: str, disk_bps: float | None) -> str | None:
    """Why a search leaves nvme offloads out for `cfg` (None: it tries them): a ranking target
    with no disk figure and no --disk-gbps, or a config the nvme step refuses
    (`fsdp_jax.nvme.check_streamable`: an optimizer that is not elementwise, no layer stack,
    frozen params, a model with state)."""
    try:
        disk_bytes_per_s(target_name, disk_bps)
    except ValueError as e:
        return str(e)
    if cfg.optimizer.name == "adafactor":
        return "optimizer.name=adafactor is not elementwise: the nvme step updates one layer at a time"
    if not cfg.model.scan_layers:
        return "model.scan_layers=false leaves no layer stack to stream from disk"
    if lora_spec(cfg) is not None:
        return "LoRA (frozen params) is not supported by the nvme step yet"
    if is_preference(cfg):
        return "a preference objective keeps its reference in model state, which the nvme step does not thread yet"
    return None
