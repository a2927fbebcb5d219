"""The fastest configuration that fits: a search over strategy, remat policy, microbatches
and host offload (and, when asked, batch and sequence length), cheap first.

    space = SearchSpace(offloads=("none", "optimizer", "optimizer+params"))
    doc = search(cfg, 8, space, Limits(device_memory=80 * 10**9), target=make_target("h100", 8))
    doc["winner"]["overrides"]   # ["mesh.strategy=full_shard", "remat=dots", ...]

1. Enumerate every candidate the config's mesh and batch allow.
2. Analytic pass (no compile): the memory model (`memory_model.analytic_memory`) on the
   trainer's abstract step, built once per strategy x offload (the variable terms,
   activations, batch and the microbatch accumulator, come from each candidate's config),
   and a predicted step time (`step_time.predict` over the analytic collective bytes
   below, plus the host<->device transfers of offload). Prune a candidate only when even
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
   then redone over the compiled program's own collective bytes. Another round follows
   while an uncompiled candidate still ranks above the best verified fit, up to
   `Limits.max_compiles` compiles in all.

Candidates with state offload compile on a GPU target as `plan.py --target ... --offload X`
does: compile-only GPU devices offer no host memory kind, so the step compiles without
offload and its device side is that compile minus the state resting on the host plus its
transient device copies (`fsdp_jax.app.fit.target_offload`). Elsewhere (TPU targets, CPU,
where XLA:CPU moves nothing between memory kinds) and for offloading remat policies they
are judged by the analytic model only.
Compiling is `fsdp_jax.app.fit.search_compile`; the user's side (flags, table, YAML) is
`fsdp_jax.app.fit.search_report`.
"""

from __future__ import annotations

import dataclasses
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np

from fsdp_jax.app.fit.memory_model import analytic_memory, saved_per_token
from fsdp_jax.app.fit.search_space import (  # noqa: F401 (re-exported)
    ANALYTIC_OVER,
    DEVICE_REMATS,
    HOST_LINK_BYTES_PER_S,
    MIN_SEQ,
    OFFLOAD_SETTINGS,
    VARY,
    Limits,
    SearchError,
    SearchSpace,
    candidate_config,
    enumerate_candidates,
    overrides,
    shapes,
)
from fsdp_jax.app.fit.step_build import build_step, mesh_shape, target_mesh_sizes


def analytic_communication(cfg, strategy: str, sizes: tuple[int, int, int], hosts: int) -> dict[str, Any]:
    """Wire bytes each device sends per step (ring algorithms), by strategy, with P the params
    in the compute dtype, F = fsdp, D = data, N = D x F, M microbatches: DDP 2P(N-1)/N (ZeRO-1
    the same plus P(N-1)/N for the updated params); ZeRO-2 2MP(F-1)/F; ZeRO-3 3MP(F-1)/F; HSDP
    that plus 2(P/F)(D-1)/D across data. Gradients travel in the compute dtype: the XLA:GPU
    compiles of 7B and 70B reduce-scatter bf16 grads even under reduce=float32 (BENCHMARKS.md:
    these formulas are within 0.3% of their all-gather + reduce-scatter + all-reduce bytes).
    All bytes of a group that spans hosts count as cross-host. A compiled candidate replaces
    this with its program's own bytes."""
    from fsdp_jax.app.models.llama import count_params
    from fsdp_jax.precision import Policy

    p = count_params(cfg.model) * np.dtype(Policy.parse(cfg.precision).compute_dtype).itemsize
    data, fsdp, _ = sizes
    n, m = data * fsdp, cfg.train.microbatches
    ring = lambda k: (k - 1) / k if k > 1 else 0.0  # noqa: E731
    if strategy in ("no_shard", "shard_opt"):
        within = 2 * p * ring(n) + (p * ring(n) if strategy == "shard_opt" else 0)
        across = 0.0
    else:
        within = m * (2 if strategy == "shard_grad_op" else 3) * p * ring(fsdp)
        across = 2 * p / fsdp * ring(data) if strategy == "hybrid_shard" else 0.0
    spans = hosts > 1 and (n if strategy in ("no_shard", "shard_opt") else fsdp) > n // hosts
    total = within + across
    cross = total if spans else (across if hosts > 1 and data > 1 else 0.0)
    return {"total_wire_bytes": int(total), "analytic": {"cross_host_wire_bytes": int(cross)}}


def recompute_flops_per_token(model, seq_len: int, remat: str) -> float:
    """Forward matmul FLOPs per token the backward pass recomputes under `remat` beyond what
    `step_time.predict` counts (it counts `full` only). Per layer, with D, F, Q = heads x
    head_dim, K = kv heads x head_dim, S: qkv 2D(Q+2K), attention core 4SQ, out 2QD, gate+up
    4DF, down 2FD; `dots` saves every matmul output, `dots_no_batch` all but the attention
    core, `save_qkv_attn_mlp_out` recomputes the core and gate/up, `save_attn_mlp_out` also
    qkv (its `attn_out` is after the out projection, `mlp_out` after down)."""
    d, f = model.d_model, model.ffn_dim
    q, k = model.n_heads * model.head_dim, model.n_kv_heads * model.head_dim
    qkv, core, gate_up = 2 * d * (q + 2 * k), 4 * seq_len * q, 4 * d * f
    per_layer = {
        "dots_no_batch": core,
        "save_qkv_attn_mlp_out": core + gate_up,
        "save_attn_mlp_out": qkv + core + gate_up,
    }
    name = remat.removeprefix("offload_")
    name = {"attn_mlp_out": "save_attn_mlp_out", "qkv_attn_mlp_out": "save_qkv_attn_mlp_out"}.get(name, name)
    return float(model.n_layers * per_layer.get(name, 0))


def predict_step(cfg, target_name: str, n_devices: int, result: dict[str, Any]) -> dict[str, Any] | None:
    """`step_time.predict` plus what it leaves out: the recompute of remat policies other
    than `full` (`recompute_flops_per_token`, at the same GEMM efficiency) and the offload
    transfers (`analytic.transfer_per_step` over HOST_LINK_BYTES_PER_S, not hidden: the
    update waits for them). step = max(compute + recompute, comm) + update + host. `target_name`:
    a GPU in step_time.SPECS or a TPU generation (its chip's figures, `step_time.peaks`); None
    where step_time.predict has none (traffic over an unpublished network)."""
    from fsdp_jax.app.fit.step_time import GEMM_EFFICIENCY, peaks, predict

    p = predict(cfg, target_name, n_devices, result)
    if p is None:  # crosses a network whose bandwidth is unpublished
        return None
    tokens = cfg.data.seq_len * cfg.train.global_batch / n_devices
    extra_s = (
        tokens
        * recompute_flops_per_token(cfg.model, cfg.data.seq_len, cfg.remat)
        / (peaks(target_name)[0] * GEMM_EFFICIENCY)
    )
    host_s = result["analytic"].get("transfer_per_step", 0) / HOST_LINK_BYTES_PER_S
    g = lambda x: float(f"{x:.4g}")  # noqa: E731
    step = max(p["compute_s"] + extra_s, p["comm_s"]) + p["update_s"] + host_s
    scale = p["step_s"] / step if step else 1.0
    p.update(
        step_s=g(step),
        tokens_per_s_per_gpu=g(tokens / step),
        tflops_per_gpu=g(p["tflops_per_gpu"] * scale),
        mfu=g(p["mfu"] * scale),
        recompute_s=g(extra_s),
        host_s=g(host_s),
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
    from fsdp_jax.app.fit.step_time import peaks

    if target.hosts > 1 and peaks(target.name)[2] is None:
        return "h100", (
            f"{target.name} publishes no data-center network bandwidth and this target spans "
            f"{target.hosts} slices: ranked by the analytic cost (the H100 roofline), not a "
            f"prediction for {target.name}"
        )
    return target.name, None


def compilable(c: dict[str, Any], gpu_target: bool = False) -> bool:
    """Whether a compiler here can measure `c`'s device peak: no host memory involved, or
    (`gpu_target`) a state offload, whose device side a compile-only GPU target plans from
    the same step compiled without offload (`fsdp_jax.app.fit.target_offload`). An
    offloading remat policy moves activations, which that does not model."""
    from fsdp_jax.remat import OFFLOADING

    return c["remat"] not in OFFLOADING and (c["offload"] == "none" or gpu_target)


def analytic_pass(
    cfg,
    n_devices: int,
    cands: list[dict],
    limits: Limits,
    hosts: int,
    per_host: int,
    target_name: str,
    devices,
    gpu_target: bool = False,
) -> None:
    """Fill each candidate's `analytic`, `predicted` and first `status` in place;
    `gpu_target`: compiles go to a GPU target, where offload candidates compile too."""
    builds: dict[tuple[str, str], Any] = {}
    for c in cands:
        key = (c["strategy"], c["offload"])
        if key not in builds:
            base = candidate_config(
                cfg,
                {
                    **c,
                    "remat": cfg.remat,
                    "microbatches": 1,
                    "global_batch": cfg.train.global_batch,
                    "seq_len": cfg.data.seq_len,
                },
            )
            builds[key] = build_step(base, c["strategy"], devices, tuple(c["mesh"].values()))
        b = builds[key]
        ccfg = candidate_config(cfg, c)
        batch = jax.ShapeDtypeStruct((c["global_batch"], c["seq_len"] + 1), np.int32, sharding=b.plan.batch)
        a = analytic_memory(dataclasses.replace(b, cfg=ccfg, batch=batch))
        a["host_per_host"] = a["host"] * per_host
        c["analytic"] = a
        comm = analytic_communication(ccfg, c["strategy"], tuple(c["mesh"].values()), hosts)
        c["predicted"] = predict_step(ccfg, target_name, n_devices, {"analytic": a, "communication": comm})
        c["predicted"]["source"] = "analytic"
        c["compilable"] = compilable(c, gpu_target)
        c["compiled"] = None
        dev = a["device_total"]
        if limits.host_memory is not None and a["host_per_host"] > limits.host_memory:
            c["status"], c["reason"] = "dropped", "host memory over --host-memory"
        elif dev <= limits.budget:
            c["status"], c["reason"] = "fits", "analytic"
        elif c["compilable"] and lower_bound(a) <= limits.budget:
            c["status"], c["reason"] = "edge", "analytic over the budget, within the model's error"
        else:
            c["status"] = "dropped"
            c["reason"] = (
                "over memory (analytic, even at its error bound)"
                if c["compilable"]
                else "over memory (analytic; offload is not compiled)"
            )


def lower_bound(a: dict[str, int]) -> float:
    """The least compiled peak the analytic model allows: params + optimizer + batch are the
    compiled argument bytes exactly (0.00% on every GPU/TPU compile measured); the transient
    rest (grads, gathered params, activations) may come out up to ANALYTIC_OVER lower."""
    exact = a["params"] + a["optimizer"] + a["batch"]
    return exact + (a["total"] - exact) * (1 - ANALYTIC_OVER)


def rank(cands: list[dict]) -> list[dict]:
    """Best first: predicted tokens/s per GPU, then the smaller device peak."""
    return sorted(cands, key=lambda c: (-c["predicted"]["tokens_per_s_per_gpu"], device_peak(c)))


def device_peak(c: dict[str, Any]) -> int:
    """The compiled device peak when compiled, else the analytic device total."""
    return c["compiled"]["device_peak"] if c.get("compiled") else c["analytic"]["device_total"]


def verified(c: dict[str, Any]) -> bool:
    """A candidate that fits and that no compile here could still overturn."""
    return c["status"] == "fits" and (c["compiled"] is not None or not c["compilable"])


def pick_to_compile(ranked: list[dict], limits: Limits, already: int) -> list[dict]:
    """Among the candidates ranked above the best verified one (all, before any is): the `top`
    best-ranked uncompiled ones that fit analytically and the `edge` best-ranked at the memory
    edge, at most `max_compiles - already`. Empty when the best-ranked fit is verified."""
    stop = next((i for i, c in enumerate(ranked) if verified(c)), len(ranked))
    todo = [c for c in ranked[:stop] if c["compilable"] and c["compiled"] is None and c["status"] != "dropped"]
    top = [c for c in todo if c["status"] == "fits"][: limits.top]
    edge = [c for c in todo if c["status"] == "edge"][: limits.edge]
    return [c for c in ranked if any(c is x for x in top + edge)][: max(limits.max_compiles - already, 0)]


# ----------------------------------------------------------------------------- the search


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
    headroom kept), "notes", "wall_s"}. Needs `n_devices` devices in this process (fake
    CPU devices will do) for the analytic pass. Raises SearchError for an empty space or
    an impossible constraint; a search that finds nothing returns winner None."""
    from fsdp_jax.verify import devices_for

    t0 = time.perf_counter()
    say = progress or (lambda msg: None)
    _check_space(cfg, space, limits)
    hosts = target.hosts if target is not None else 1
    per_host = target.gpus_per_host if target is not None else min(n_devices, 8)
    if target is not None:
        mesh_for = lambda s: target_mesh_sizes(cfg, s, n_devices, hosts)  # noqa: E731
    else:
        mesh_for = lambda s: mesh_shape(cfg, s, n_devices)  # noqa: E731
    cands, notes = enumerate_candidates(cfg, n_devices, space, mesh_for)
    say(f"{len(cands)} candidates; analytic pass (memory model + roofline) ...")
    predict_on, cost_note = ranking_target(target)
    gpu = cost_note is None  # a prediction for the target (a GPU or a TPU chip)
    gpu_target = target is not None and target.platform == "gpu"
    analytic_pass(
        cfg, n_devices, cands, limits, hosts, per_host, predict_on, devices_for(n_devices), gpu_target=gpu_target
    )
    for c in cands:
        c["overrides"] = overrides(cfg, c)
    host = [c["analytic"]["host_per_host"] for c in cands if c["reason"] == "host memory over --host-memory"]
    if len(host) == len(cands):
        raise SearchError(
            f"--host-memory: {limits.host_memory / 1e9:.2f} GB per host is less than every candidate "
            f"needs (at least {min(host) / 1e9:.2f} GB); allow more, or add --offload none"
        )
    dropped = sum(c["status"] == "dropped" for c in cands)
    say(f"analytic pass: {len(cands) - dropped} kept, {dropped} dropped, {time.perf_counter() - t0:.1f} s")
    compiled_n = _compile_rounds(cfg, n_devices, cands, limits, target, gpu, say)
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
    if cost_note:
        notes.append(cost_note)
    notes.append(
        (
            "offload candidates compile for the GPU target without offload, their device side planned "
            "from that compile (fsdp_jax.app.fit.target_offload)"
            if gpu_target
            else "offload candidates are judged by the analytic model only"
        )
        + f"; host<->device transfers at {HOST_LINK_BYTES_PER_S / 1e9:.0f} GB/s per GPU are added "
        "to their step, not hidden"
    )
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
        },
        "counts": {
            "candidates": len(cands),
            "compiled": compiled_n,
            "fits": sum(c["status"] == "fits" for c in cands),
            "dropped": sum(c["status"] == "dropped" for c in cands),
        },
        "candidates": ranked,
        "dropped": counts,
        "winner": winner,
        "smallest_fitting_memory": None if smallest is None else limits.memory_for(smallest),
        "notes": notes,
        "wall_s": round(time.perf_counter() - t0, 1),
    }


def _check_space(cfg, space: SearchSpace, limits: Limits) -> None:
    """SearchError for an empty space or an impossible headroom; PlanError for a remat
    policy the memory model has no formula for."""
    if limits.budget <= 0:
        raise SearchError(
            f"--headroom: {limits.headroom_bytes / 1e9:.2f} GB leaves nothing of the "
            f"{limits.device_memory / 1e9:.2f} GB device memory"
        )
    bad = [r for r in space.remats if r not in DEVICE_REMATS and not r.startswith("offload_")]
    for r in space.remats:
        saved_per_token(cfg.model, r, cfg.data.seq_len, 2)  # PlanError for a policy without a formula
    if bad or not (space.strategies and space.remats and space.offloads):
        raise SearchError("--search: the search space is empty (a strategy, remat and offload list is needed)")


def _compile_rounds(
    cfg, n_devices: int, cands: list[dict], limits: Limits, target, gpu: bool, say: Callable[[str], None]
) -> int:
    """Compile rounds (one kernel cache for all): the best-ranked uncompiled candidates near
    the top and the memory edge, until none ranks above the best verified fit; the count."""
    compiled_n = 0
    with tempfile.TemporaryDirectory(prefix="fsdp_jax-search-") as scratch:  # one kernel cache, every round
        kernels = Path(scratch) / "xla_gpu_kernels.bin"
        while True:
            ranked = rank(cands)
            todo = pick_to_compile(ranked, limits, compiled_n)
            if not todo:
                break
            say(
                f"compiling {len(todo)} candidate(s) near the top and the memory edge"
                + (f" for {target.describe()} (one process, the kernel cache shared)" if target is not None else "")
            )
            from fsdp_jax.app.fit.search_compile import compile_candidates

            for c, r in zip(todo, compile_candidates(cfg, n_devices, todo, target, say, kernel_cache=kernels)):
                _apply_compiled(cfg, c, r, limits, n_devices, target.name if gpu else None)
            compiled_n += len(todo)
    return compiled_n


def _apply_compiled(cfg, c: dict, r: dict, limits: Limits, n_devices: int, gpu_name: str | None) -> None:
    """Record a compile: the device peak decides fits; a GPU compile's collective bytes redo
    the prediction."""
    mem = r["compiled"]
    c["compiled"] = {k: mem[k] for k in ("argument", "temp", "peak", "device_peak")}
    c["compiled"].update(
        compile_s=r["compile_s"],
        platform=r["platform"],
        warnings=r["warnings"],
        refused=r.get("refused"),
        basis=r.get("offload_basis", "compiled"),
    )
    if mem["device_peak"] <= limits.budget:
        c["status"], c["reason"] = "fits", "compiled"
    else:
        c["status"], c["reason"] = "dropped", "over memory (compiled)"
    if gpu_name is not None and r.get("platform") in ("gpu", "tpu") and not r.get("refused"):
        p = predict_step(
            candidate_config(cfg, c),
            gpu_name,
            n_devices,
            {"analytic": c["analytic"], "communication": r["communication"]},
        )
        if p is not None:
            c["predicted"] = {**p, "source": "compiled"}
