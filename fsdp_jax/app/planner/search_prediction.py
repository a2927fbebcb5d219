"""The search's cost model: the wire bytes each device sends per step by strategy
(`analytic_communication`), the forward FLOPs a remat policy recomputes
(`recompute_flops_per_token`), and a candidate's predicted step time over them
(`predict_step`: `step_time.predict` plus recompute and offload transfers), on the GPU or
TPU chip the search ranks by (`ranking_target`).
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fsdp_jax.app.models.decoder import count_params
from fsdp_jax.app.models.lora import adapter_param_count, spec_from_config
from fsdp_jax.app.planner import nvme_plan
from fsdp_jax.app.planner.nvme_plan import disk_bytes_per_s
from fsdp_jax.app.planner.residuals import rematerialised
from fsdp_jax.app.planner.step_time import BAND, fp8_layer_params, predict, roofline_constants, step_tokens
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.remat import FORWARD


def analytic_communication(
    cfg, strategy: str, sizes: tuple[int, int, int], hosts: int, target: str | None = None
) -> dict[str, Any]:
    """Wire bytes each device sends per step (ring algorithms), by strategy, with P the params
    and G the trained params (P itself; with LoRA the adapters only, and P the base: the
    adapters' rank dim is replicated, most of their bytes are never gathered), both in the
    compute dtype, F = fsdp, D = data, N = D x F, M microbatches: DDP 2G(N-1)/N (ZeRO-1 the same plus
    G(N-1)/N for the updated params); ZeRO-2 M(P + G)(F-1)/F (the gather, the grads'
    reduce-scatter); ZeRO-3 M(2P + G)(F-1)/F (gathered again in the backward); HSDP that plus
    2(G/F)(D-1)/D across data. So 2P, 3P, 2MP and 3MP in full training; under LoRA the frozen
    base is gathered where its strategy gathers params (its input gradients need it) and
    sends no gradient and no update. Gradients travel in the compute dtype: the XLA:GPU
    compiles of 7B and 70B reduce-scatter bf16 grads even under reduce=float32 (BENCHMARKS.md:
    these formulas are within 0.3% of their all-gather + reduce-scatter + all-reduce bytes).
    All bytes of a group that spans hosts count as cross-host. Under FP8 weight gathers
    (`fp8_gathered_params`) ZeRO-3's and HSDP's per-layer gathers move the layers' params in
    f8, 1 byte each (P becomes P8 in 2P; `target`, a perf-table name, says whether tokamax's
    kernels keep the routed experts in the compute dtype). A compiled candidate replaces this
    with its program's own bytes."""

    width = np.dtype(Policy.parse(cfg.precision).compute_dtype).itemsize
    lora = spec_from_config(cfg.lora)
    adapters = 0 if lora is None else adapter_param_count(cfg.model, lora)
    p = count_params(cfg.model) * width
    g = p if lora is None else adapters * width
    p8 = p - fp8_gathered_params(cfg, strategy, target) * (width - 1)  # the per-layer gathers' bytes
    data, fsdp, _ = sizes
    n, m = data * fsdp, cfg.train.microbatches
    ring = lambda k: (k - 1) / k if k > 1 else 0.0  # noqa: E731
    if strategy in ("no_shard", "shard_opt"):
        within = 2 * g * ring(n) + (g * ring(n) if strategy == "shard_opt" else 0)
        across = 0.0
    else:
        within = m * ((p if strategy == "shard_grad_op" else 2 * p8) + g) * ring(fsdp)
        across = 2 * g / fsdp * ring(data) if strategy == "hybrid_shard" else 0.0
    spans = hosts > 1 and (n if strategy in ("no_shard", "shard_opt") else fsdp) > n // hosts
    total = within + across
    cross = total if spans else (across if hosts > 1 and data > 1 else 0.0)
    return {"total_wire_bytes": int(total), "analytic": {"cross_host_wire_bytes": int(cross)}}


def fp8_gathered_params(cfg, strategy: str, target: str | None = None) -> int:
    """Params whose per-layer all-gathers move f8 (docs/fp8.md "FP8 weight gathers"): under
    `precision ...,matmul=fp8` with `fp8.gather` not false, for full_shard / hybrid_shard, the
    decoder layers' params (`step_time.fp8_layer_params`: not routed experts that tokamax's
    kernels run on `target`); else 0."""
    if cfg.fp8.gather is False or strategy not in ("full_shard", "hybrid_shard"):
        return 0
    return fp8_layer_params(cfg, target=target)


def recompute_flops_per_token(model, seq_len: int, remat: str) -> float:
    """Forward matmul FLOPs per token the backward pass recomputes under `remat` beyond what
    `step_time.predict` counts (it counts a recomputed `FORWARD`, `full`): the matmuls its
    record recomputes (`RematPolicy.recomputes`). Per layer, with D, F, Q = heads x head_dim,
    K = kv heads x head_dim, S: qkv 2D(Q+2K), attention core 4SQ, out (`attn_out`) 2QD,
    gate+up 4DF, down (`mlp_out`) 2FD; so `dots` recomputes none, `dots_no_batch` the attention
    core, `save_qkv_attn_mlp_out` the core and gate/up, `save_attn_mlp_out` also qkv (its
    `attn_out` is after the out projection, `mlp_out` after down), an offloading policy as
    the one that saves what it offloads."""
    d, f = model.d_model, model.ffn_dim
    q, k = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    flops = {"qkv": 2 * d * (q + 2 * k), "attn_core": 4 * seq_len * q, "attn_out": 2 * q * d}
    flops.update(gate_up=4 * d * f, mlp_out=2 * f * d, **{FORWARD: 0})  # step_time counts it
    per_layer = sum(flops[m] for m in rematerialised(remat).recomputes)
    return float(model.n_layers * per_layer)


def predict_step(
    cfg, target_name: str, n_devices: int, result: dict[str, Any], disk_bps: float | None = None
) -> dict[str, Any] | None:
    """The candidate's predicted step: `step_time.predict` (op by op when `result` carries a
    compiled program's `op_inventory`, the figure `plan --target` reports; else the roofline
    with the same table's constants) plus what it leaves out: for the roofline, the recompute
    of remat policies other than `full` (`recompute_flops_per_token`, at the table's peak x
    GEMM efficiency); for both, the offload transfers of a program that moves nothing
    (`analytic.transfer_per_step` over the table's host link, not hidden: the update waits
    for them; with an nvme offload the slower of that and its disk I/O, `nvme_plan.io_seconds`, at
    `disk_bps` or the target's). Roofline: step = max(compute + recompute, comm) + update +
    host. `target_name`:
    a GPU of the step-time table or a TPU generation; None where step_time.predict has none
    (traffic over an unpublished network)."""

    p = predict(cfg, target_name, n_devices, result)
    if p is None:  # crosses a network whose bandwidth is unpublished
        return None
    tokens = step_tokens(cfg, n_devices)
    ops = p.get("model") == "ops"  # from the compiled program: its recompute is in it already
    k = roofline_constants(target_name)
    recompute = recompute_flops_per_token(cfg.model, cfg.data.seq_len, cfg.remat)
    extra_s = 0.0 if ops else tokens * recompute / (k["peak"] * k["efficiency"])
    # compile-only GPUs plan offload without host memory: the program moves nothing, add the formula's
    host_s = 0.0 if ops and p["host_s"] else result["analytic"].get("transfer_per_step", 0) / k["host"]
    disk_s = 0.0
    compute = p["step_s"] if ops else max(p["compute_s"] + extra_s, p["comm_s"]) + p["update_s"]
    if result["analytic"].get("disk_per_step"):  # nvme: the update (and the params' layers) stream from the disks
        io = nvme_plan.io_seconds(result["analytic"], k["host"], disk_bytes_per_s(target_name, disk_bps)[0], compute)
        disk_s = io["disk_s"]
        host_s = io["io_s"] if "disk_forward" in result["analytic"] else max(host_s, disk_s)
    g = lambda x: float(f"{x:.4g}")  # noqa: E731
    step = compute + host_s
    scale = p["step_s"] / step if step else 1.0
    p.update(
        step_s=g(step),
        # the band is +-BAND around the step it reports, host transfers and recompute included
        band_s=[g(step * (1 - BAND)), g(step * (1 + BAND))],
        # from the op walk: scale the plan's own figure (`step` is rebuilt from the rounded step_s)
        tokens_per_s_per_gpu=g(p["tokens_per_s_per_gpu"] * scale if ops else tokens / step),
        tflops_per_gpu=g(p["tflops_per_gpu"] * scale),
        mfu=g(p["mfu"] * scale),
        recompute_s=g(extra_s),
        host_s=g(host_s),
        disk_s=g(disk_s),
        bound="compute" if p["compute_s"] + extra_s >= p["comm_s"] else "communication",
    )
    return p


def ranking_target(target) -> tuple[str, str | None]:
    """(the step_time target the search predicts with, a note when that is not a prediction
    for `target`): the target itself, GPU or TPU (a TPU chip's peak, ICI and HBM figures);
    without a target, or for several slices of a TPU generation whose data-center
    bandwidth is unpublished (v4, v6e), the H100 roofline as an analytic cost."""
    if target is None:
        return "h100", (
            "no GPU/TPU target: ranked by the analytic cost (the H100 roofline of step_time over "
            "analytic collective bytes), not a prediction for this machine"
        )

    if target.hosts > 1 and roofline_constants(target.table)["slow"] is None:
        return "h100", (
            f"{target.name} publishes no data-center network bandwidth and this target spans "
            f"{target.hosts} slices: ranked by the analytic cost (the H100 roofline), not a "
            f"prediction for {target.name}"
        )
    return target.table, None
