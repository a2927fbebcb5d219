"""LoRA step vs full fine-tuning on the same config and batch, on 8 CPU devices: tokens/s
of the measured steps (after warm-up; each step blocked on), the compiled step's peak bytes
per device (`memory_analysis()`), and the state's bytes per device (params, optimizer).

    python benchmarks/lora_vs_full.py [--steps 10] [--rank 16] [key=value ...]

Overrides go to configs/small.yaml for both runs (e.g. precision=params=float32,compute=bfloat16).
CPU figures compare the two steps on one machine; they are not a GPU prediction.
"""

import argparse
import json
import sys
import time

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", 8)

from fsdp_jax.app.config.parse import load_config  # noqa: E402
from fsdp_jax.app.planner.abstract_step import build_step, sample_batch  # noqa: E402
from fsdp_jax.hlo.memory import tree_bytes_per_device  # noqa: E402


def measure(cfg, steps: int) -> dict:
    b = build_step(cfg)
    compiled = b.compile()
    peak = compiled.memory_analysis().peak_memory_in_bytes
    state = b.init_state(jax.random.key(0))
    batch = jax.device_put(sample_batch(cfg, b.batch, np.random.default_rng(0)), b.plan.batch)
    for _ in range(2):  # warm-up (compile, first dispatch)
        state, m = b.step(state, batch)
        float(m["loss"])
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = b.step(state, batch)
        float(m["loss"])  # block on each step (CPU: bound the steps in flight)
    dt = (time.perf_counter() - t0) / steps
    tokens = cfg.train.global_batch * cfg.data.seq_len
    return {
        "tokens_per_s": round(tokens / dt, 1),
        "step_s": round(dt, 4),
        "peak_bytes_per_device": int(peak),
        "params_bytes_per_device": tree_bytes_per_device(b.state.params),
        "opt_state_bytes_per_device": tree_bytes_per_device(b.state.opt_state),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--config", default="configs/small.yaml")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    out = {"jax": jax.__version__, "devices": jax.device_count(), "config": args.config, "overrides": args.overrides}
    for name, extra in (("full", []), ("lora", [f"lora.rank={args.rank}", f"lora.alpha={2 * args.rank}"])):
        cfg = load_config(args.config, [*args.overrides, *extra])
        out[name] = measure(cfg, args.steps)
    out["lora_vs_full"] = {
        "tokens_per_s": round(out["lora"]["tokens_per_s"] / out["full"]["tokens_per_s"], 3),
        "peak_bytes": round(out["lora"]["peak_bytes_per_device"] / out["full"]["peak_bytes_per_device"], 3),
        "opt_state_bytes": round(
            out["lora"]["opt_state_bytes_per_device"] / out["full"]["opt_state_bytes_per_device"], 4
        ),
    }
    json.dump(out, sys.stdout, indent=2)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
