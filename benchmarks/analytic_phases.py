"""The analytic memory model's phases per strategy, without compiling: what a plan's analytic
total is made of since the peak became the larger of two phases of the backward pass
(`fsdp_jax/app/planner/gathered_memory.py`, docs/planning.md "Phases of the backward pass").

    python benchmarks/analytic_phases.py --config configs/llama2_7b.yaml --devices 8 [key=value ...]

Prints, per strategy (GB = 10^9 bytes per device): the analytic total, the layer backward's and
the reduction's totals, and `shift`: how much lower the total is than the rule before
2026-12-07 (the layer's whole unreduced grads in the layer backward), which is the layer's
unreduced grads less the largest weight's on XLA:CPU devices and 0 on GPU / TPU targets. The
compiled figures of a plan do not depend on the model: only its analytic column moves.
"""

from __future__ import annotations

import argparse

import jax

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.planner.abstract_step import build_step
from fsdp_jax.app.planner.gathered_memory import compute_copy_bytes
from fsdp_jax.app.planner.memory_model import analytic_memory
from fsdp_jax.sharding.precision import Policy

STRATEGIES = ("no_shard", "shard_opt", "shard_grad_op", "full_shard", "hybrid_shard")


def phases(b) -> dict[str, float]:
    a = analytic_memory(b)
    fixed = a["params"] + a["grads"] + a["optimizer"] + a["batch"]
    policy = Policy.parse(b.cfg.precision)
    r = compute_copy_bytes(b.state.params, b.plan, b.model.logical_axes, policy.reduce_dtype)
    per_layer = b.plan.strategy.params  # the strategies that hold one layer's unreduced grads
    cpu = b.mesh.devices.flat[0].platform == "cpu"
    shift = (r["layer"] - r["largest_in_layer"]) if per_layer and cpu else 0
    backward = fixed + a["gathered"] + a["activations"]
    return {
        "total": a["total"] / 1e9,
        "backward": backward / 1e9,
        "reduction": (fixed + a["reduction_phase"]) / 1e9,
        "before": (backward + shift) / 1e9,
        "shift": shift / 1e9,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--devices", type=int, default=8)
    ap.add_argument("--strategies", default=",".join(STRATEGIES))
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.devices)
    cfg = load_config(args.config, args.overrides)
    print(f"{'strategy':<14} {'total':>8} {'backward':>9} {'reduction':>10} {'before':>8} {'shift':>7}  (GB)")
    for s in args.strategies.split(","):
        p = phases(build_step(cfg, s))
        print(f"{s:<14} " + " ".join(f"{p[k]:>{w}.2f}" for k, w in zip(p, (8, 9, 10, 8, 7))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
