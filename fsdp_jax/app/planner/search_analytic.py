"""The search's analytic pass (no compile): each candidate's memory from the memory model on
the trainer's abstract step, its predicted step time, and a first status: fits, edge (over
the budget, but within the model's error: `lower_bound`) or dropped.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import numpy as np

from fsdp_jax.app.planner import nvme_plan
from fsdp_jax.app.planner.abstract_step import build_step
from fsdp_jax.app.planner.memory_model import DEVICES_PER_HOST, analytic_memory
from fsdp_jax.app.planner.nvme_plan import is_nvme
from fsdp_jax.app.planner.search_prediction import analytic_communication, predict_step
from fsdp_jax.app.planner.search_space import ANALYTIC_OVER, Limits, candidate_config
from fsdp_jax.sharding.remat import remat_policy


def compilable(c: dict[str, Any], gpu_target: bool = False) -> bool:
    """Whether a compiler here can measure `c`'s device peak: no host memory involved, or
    (`gpu_target`) a state offload, whose device side a compile-only GPU target plans from
    the same step compiled without offload (`fsdp_jax.app.planner.target_offload`). An
    offloading remat policy moves activations, which that does not model."""

    if remat_policy(c["remat"]).offloads:
        return False
    return c["offload"] == "none" or is_nvme(c["offload"]) or gpu_target  # nvme: the step without offload


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
    platform: str | None = None,
) -> None:
    """Fill each candidate's `analytic`, `predicted` and first `status` in place;
    `gpu_target`: compiles go to a GPU target, where offload candidates compile too;
    `platform`: the target's ("gpu", "tpu"; None: `devices`'), which the memory model follows."""
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
        a = analytic_memory(dataclasses.replace(b, cfg=ccfg, batch=batch), platform)
        a["host_per_host"] = a["host"] * per_host
        if "disk" in a and per_host != DEVICES_PER_HOST:  # nvme: a host's files and their I/O, rescaled
            nvme_plan.rescale_host(a, per_host, DEVICES_PER_HOST)
        c["analytic"] = a
        comm = analytic_communication(ccfg, c["strategy"], tuple(c["mesh"].values()), hosts, target_name)
        c["predicted"] = predict_step(
            ccfg, target_name, n_devices, {"analytic": a, "communication": comm}, limits.disk_bytes_per_s
        )
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
