#!/usr/bin/env python
"""Why the test suite sets `--xla_backend_optimization_level=0` and, where jaxlib has it,
`--xla_cpu_use_fusion_emitters=false` (tests/conftest.py): how long XLA:CPU takes to
compile the tiny decoder's sharded init and train step with each against the default, and
what the HLO-level results the tests assert (collective counts, memory_analysis() bytes,
the loss, while loops) do under each.

    PYTHONPATH=$PWD python benchmarks/compile_opt_level.py [--repeats 3]

Each measurement runs in a fresh child process with no persistent compilation cache,
so every compile is cold. Prints a markdown table (median of --repeats).
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, sys.argv[1])
import optax
import fsdp_jax as fj
from helpers import tiny_llama, token_batches
m, loss_fn = tiny_llama(remat="dots")
opt = optax.adamw(1e-3)
t0 = time.perf_counter()
state, plan = fj.init_train_state(m.init, opt, fj.make_mesh(data=1, fsdp=-1, tensor=1),
                                  jax.random.key(0), "full_shard", logical_axes=m.logical_axes)
t1 = time.perf_counter()
step = fj.make_train_step(loss_fn, opt, plan, precision="params=float32,compute=bfloat16")
batch = token_batches(1)[0]
lowered = step.lower(state, batch)
t_lower = time.perf_counter()
compiled = lowered.compile()
t2 = time.perf_counter()
mem, text = compiled.memory_analysis(), compiled.as_text()
state, metrics = step(state, batch)
t3 = time.perf_counter()
state, metrics = step(state, batch)
jax.block_until_ready(metrics)
t4 = time.perf_counter()
print(json.dumps({"init_s": t1 - t0, "step_trace_lower_s": t_lower - t1,
                  "step_compile_s": t2 - t_lower, "first_call_s": t3 - t2,
                  "step_s": t4 - t3, "temp_bytes": mem.temp_size_in_bytes,
                  "argument_bytes": mem.argument_size_in_bytes,
                  "all_gathers": text.count("all-gather("), "all_reduces": text.count("all-reduce("),
                  "while_loops": text.count(" while("),
                  "loss": float(metrics["loss"])}))
"""


def measure(flags: str) -> dict | None:
    """The child's figures, or None where this jaxlib does not know one of `flags`."""
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _CHILD, str(ROOT / "tests")], env=env, capture_output=True, text=True)
    if "Unknown flag in XLA_FLAGS" in proc.stderr:
        return None
    if proc.returncode:
        raise SystemExit(proc.stderr[-3000:])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    if args.repeats < 1:
        ap.error(f"--repeats {args.repeats}: need at least 1")
    rows = {}
    o0 = "--xla_backend_optimization_level=0"
    for label, flags in [
        ("default (-O2)", ""),
        ("-O0", o0),
        ("-O0, older emitters", o0 + " --xla_cpu_use_fusion_emitters=false"),
    ]:
        runs = [measure(flags) for _ in range(args.repeats)]
        if None in runs:
            print(f"{label}: this jaxlib does not know `{flags}`", file=sys.stderr)
            continue
        rows[label] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    keys = list(next(iter(rows.values())))
    print("| XLA:CPU | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for label, r in rows.items():
        print(
            f"| {label} | "
            + " | ".join(
                f"{r[k]:.7g}" if k == "loss" else f"{r[k]:.3g}" if isinstance(r[k], float) else str(r[k]) for k in keys
            )
            + " |"
        )


if __name__ == "__main__":
    main()
