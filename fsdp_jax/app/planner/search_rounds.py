"""The search's ranking and compile rounds: candidates best first (`rank`), which to compile
next (`pick_to_compile`: the best-ranked near the top and at the memory edge, until none
ranks above the best verified fit), and each compile recorded (`apply_compiled`: the
compiled device peak decides fits; a GPU/TPU compile's program redoes the prediction op by
op, as `plan --target` predicts it). Compiling itself is `fsdp_jax.app.planner.search_compile`.
"""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_jax.app.planner.search_compile import compile_candidates
from fsdp_jax.app.planner.search_prediction import predict_step
from fsdp_jax.app.planner.search_space import Limits, candidate_config


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


def compile_rounds(
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

            for c, r in zip(todo, compile_candidates(cfg, n_devices, todo, target, say, kernel_cache=kernels)):
                apply_compiled(cfg, c, r, limits, n_devices, target.table if gpu else None)
            compiled_n += len(todo)
    return compiled_n


def apply_compiled(cfg, c: dict, r: dict, limits: Limits, n_devices: int, gpu_name: str | None) -> None:
    """Record a compile: the device peak decides fits; a GPU / TPU target's compiled program
    redoes the prediction op by op (its `op_inventory`: the step `plan --target` reports for
    the same config), or over its collective bytes where it carries no ops."""
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
            {"analytic": c["analytic"], "communication": r["communication"], "op_inventory": r.get("op_inventory")},
            limits.disk_bytes_per_s,
        )
        if p is not None:
            c["predicted"] = {**p, "source": "compiled"}
