"""An MoE train step on 8 CPU devices without and with expert parallelism over fsdp
(`mesh.rules.expert=fsdp`): tokens/s of the measured steps (after warm-up; each step blocked
on), the compiled step's peak and temp bytes per device (`compiled_memory`: argument + output -
alias + temp, as verify reports it), the all-to-all and
all-gather bytes per device per step (the compiled HLO, `collective_report`), and the state's
bytes per device.

    python benchmarks/moe_expert_parallel.py [--config configs/tiny.yaml] [--steps 3] [--repeats 3] [key=value ...]

Overrides go to both runs (e.g. model.n_experts=8 model.experts_per_token=2 model.moe_ffn_dim=352).
The two steps are compiled once each; their timings are then taken `--repeats` times in turn
(A B A B ...) so a shared machine's load falls on both alike, and each run's median is reported.
CPU figures compare the two steps on one machine; they are not a GPU prediction.
"""

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", 8)

from fsdp_jax.app.config.parse import load_config  # noqa: E402
from fsdp_jax.app.planner.abstract_step import build_step, sample_batch  # noqa: E402
from fsdp_jax.hlo.memory import collective_report, compiled_memory, tree_bytes_per_device  # noqa: E402

RUNS = (("replicated", []), ("experts_over_fsdp", ["mesh.rules.expert=fsdp"]))


def prepare(cfg) -> dict:
    """Compile the step, read its peak and collectives, and make its state and batch."""
    b = build_step(cfg)
    t0 = time.perf_counter()
    compiled = b.compile()
    compile_s = time.perf_counter() - t0
    per_step = collective_report(compiled.as_text())["per_step"]
    state = b.init_state(jax.random.key(0))
    batch = jax.device_put(sample_batch(cfg, b.batch, np.random.default_rng(0)), b.plan.batch)
    for _ in range(2):  # warm-up (first dispatch)
        state, m = b.step(state, batch)
        float(m["loss"])
    return {
        "build": b,
        "state": state,
        "batch": batch,
        "report": {
            "compile_s": round(compile_s, 1),
            "peak_bytes_per_device": compiled_memory(compiled)["peak"],
            "temp_bytes_per_device": compiled_memory(compiled)["temp"],
            "all_to_all": dict(per_step.get("all-to-all", {"count": 0, "bytes": 0})),
            "all_gather": dict(per_step.get("all-gather", {"count": 0, "bytes": 0})),
            "params_bytes_per_device": tree_bytes_per_device(b.state.params),
            "step_s": [],
        },
    }


def time_steps(run: dict, steps: int) -> float:
    b, state = run["build"], run["state"]
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = b.step(state, run["batch"])
        float(m["loss"])  # block on each step (CPU: bound the steps in flight)
    run["state"] = state
    return (time.perf_counter() - t0) / steps


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default="configs/tiny.yaml")
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    if args.steps < 1 or args.repeats < 1:
        ap.error("--steps and --repeats must be positive")
    cfgs = {name: load_config(args.config, [*args.overrides, *extra]) for name, extra in RUNS}
    if cfgs["replicated"].model.n_experts == 0:
        ap.error("model.n_experts is 0: give an MoE config (e.g. model.n_experts=8 model.experts_per_token=2)")
    runs = {name: prepare(cfg) for name, cfg in cfgs.items()}
    for _ in range(args.repeats):
        for run in runs.values():
            run["report"]["step_s"].append(round(time_steps(run, args.steps), 4))
    tokens = cfgs["replicated"].train.global_batch * cfgs["replicated"].data.seq_len
    out = {"jax": jax.__version__, "devices": jax.device_count(), "config": args.config, "overrides": args.overrides}
    for name, run in runs.items():
        rep = run["report"]
        rep["tokens_per_s_runs"] = [round(tokens / s, 1) for s in rep["step_s"]]
        rep["tokens_per_s_median"] = round(tokens / statistics.median(rep["step_s"]), 1)
        out[name] = rep
    r, e = out["replicated"], out["experts_over_fsdp"]
    out["experts_over_fsdp_vs_replicated"] = {
        "tokens_per_s": round(e["tokens_per_s_median"] / r["tokens_per_s_median"], 3),
        "peak_bytes": round(e["peak_bytes_per_device"] / r["peak_bytes_per_device"], 3),
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
