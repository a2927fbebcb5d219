"""`fsdp-jax bench-offload` once its flags have parsed (they and its description: fsdp_jax.app.cli.bench_offload)."""

from __future__ import annotations

import dataclasses
import json
import statistics
import time

import jax
import numpy as np

from fsdp_jax.app.config.checks import validate
from fsdp_jax.app.devices import use_cpu_devices
from fsdp_jax.app.planner.abstract_step import build_step, sample_batch
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.errors import UsageError
from fsdp_jax.sharding.offload import transfer_bytes
from fsdp_jax.sharding.offload_settings import OFFLOADS
from fsdp_jax.sharding.strategy import get_strategy


def run(args) -> int:

    try:
        get_strategy(args.strategy)
    except ValueError as e:  # an unknown name, listing the choices
        raise UsageError(f"--strategy: {e}") from None
    use_cpu_devices()
    cfg = load_run_config(args.config, args.overrides)
    validate(cfg, n_devices=jax.device_count())
    runs = {}
    for name in OFFLOADS:
        b = build_step(dataclasses.replace(cfg, offload=name), args.strategy)
        tokens = sample_batch(cfg, b.batch, np.random.default_rng(0))
        batch = jax.device_put(tokens, b.plan.batch)
        state = b.init_state(jax.random.key(0))
        compiled = b.step.lower(state, batch).compile()
        state, m = compiled(state, batch)  # warm-up
        float(m["loss"])
        runs[name] = [compiled, state, batch, [], transfer_bytes(b.state, name, b.plan.layered)]
    for _ in range(args.rounds):
        for r in runs.values():
            compiled, state, batch, times, _ = r
            for _ in range(args.steps):
                t = time.perf_counter()
                state, m = compiled(state, batch)
                float(m["loss"])
                times.append(time.perf_counter() - t)
            r[1] = state
    base = statistics.median(runs["none"][3])
    out = {
        "config": args.config,
        "strategy": args.strategy,
        "overrides": args.overrides,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "rounds": args.rounds,
        "steps": args.steps,
        "results": {},
    }
    for name, (_, _, _, times, moved) in runs.items():
        med = statistics.median(times)
        out["results"][name] = {
            "step_s_median": med,
            "step_s_min": min(times),
            "ratio_to_none": med / base,
            "to_device_bytes": moved["to_device"],
            "to_host_bytes": moved["to_host"],
        }
    if args.json:
        print(json.dumps(out))
    else:
        for name, r in out["results"].items():
            print(
                f"{name:18s} step {r['step_s_median'] * 1e3:8.1f} ms (min {r['step_s_min'] * 1e3:.1f})  "
                f"x{r['ratio_to_none']:.3f} vs none  host->device {r['to_device_bytes'] / 2**20:7.2f} MiB  "
                f"device->host {r['to_host_bytes'] / 2**20:7.2f} MiB per step per device",
                flush=True,
            )
    return 0
