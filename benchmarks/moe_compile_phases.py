#!/usr/bin/env python
"""How long XLA:CPU takes to trace + lower and to compile the tiny dense and the tiny
mixture-of-experts train step (tests/test_fp8_experts.py's shapes: d_model 32, 2 layers, 8
experts top-2 dropless; batch 8 x 16; full_shard on 8 CPU devices), with and without FP8
matmuls, under the test suite's XLA flags (tests/conftest.py) or others; and how large each
compiled program is (HLO lines, while loops, sorts, gathers, fusions, collectives).

    PYTHONPATH=$PWD python benchmarks/moe_compile_phases.py [--flags "..."] [--repeats 3]

Each measurement runs in a fresh child process with no persistent compilation cache, so every
compile is cold; CPU seconds (user + sys of the child's threads) of the median run. Run it with
another interpreter (jax 0.12) for that jax: `--flags` must then hold only flags its jaxlib
knows (0.12.0.1 has no `--xla_cpu_use_fusion_emitters`). Where the time goes inside XLA:
`TF_CPP_MIN_LOG_LEVEL=0 TF_CPP_VMODULE=cpu_compiler=1,hlo_pass_pipeline=1 ... --child-stderr`
logs each HLO pass's time and the LLVM codegen's ("Compiling [jit_step] for CPU using JIT").
"""

import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
SUITE_FLAGS = "--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false"
KINDS = ("dense", "moe", "dense_fp8", "moe_fp8")

_CHILD = r"""
import dataclasses, json, resource, sys, time
import jax
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_enable_compilation_cache", False)
from fsdp_jax.app.config.schema import Config, Fp8Config
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.planner.abstract_step import build_step

kind = sys.argv[1]
model = DecoderConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
if kind.startswith("moe"):
    model = dataclasses.replace(model, n_experts=8, experts_per_token=2, moe_ffn_dim=48, norm_topk_prob=True)
cfg = dataclasses.replace(Config(), model=model, precision="params=float32,compute=float32")
if kind.endswith("fp8"):
    cfg = dataclasses.replace(cfg, precision="params=float32,compute=float32,matmul=fp8",
                              fp8=Fp8Config(recipe="tensorwise", amax_history=4, emulate=True))
cfg = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, global_batch=8),
                          data=dataclasses.replace(cfg.data, seq_len=16),
                          mesh=dataclasses.replace(cfg.mesh, min_shard_size=64))

def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime

b = build_step(cfg, "full_shard", jax.devices()[:8])
c0 = cpu()
with jax.default_device(b.mesh.devices.flat[0]):
    lowered = b.step.lower(b.state, b.batch)
c1 = cpu()
text = lowered.compile().as_text()
c2 = cpu()
ops = ("while", "sort", "gather", "scatter", "fusion", "all-gather", "all-reduce", "reduce-scatter", "all-to-all")
out = {"lower_s": c1 - c0, "compile_s": c2 - c1, "stablehlo_lines": lowered.as_text().count("\n"),
       "hlo_lines": text.count("\n"), **{op: text.count(f" {op}(") for op in ops}}
print(json.dumps(out))
"""


def measure(kind: str, flags: str, child_stderr: bool = False) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("XLA_FLAGS", "JAX_COMPILATION_CACHE_DIR")}
    env.update(XLA_FLAGS=flags, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    err = None if child_stderr else subprocess.PIPE
    proc = subprocess.run([sys.executable, "-c", _CHILD, kind], env=env, stdout=subprocess.PIPE, stderr=err, text=True)
    if proc.returncode:
        raise SystemExit((proc.stderr or "")[-3000:] or f"{kind}: the child exited {proc.returncode}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--flags", default=SUITE_FLAGS, help=f"XLA_FLAGS of the children (default: {SUITE_FLAGS!r})")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated, of {', '.join(KINDS)}")
    ap.add_argument("--child-stderr", action="store_true", help="pass the children's stderr through (XLA's logs)")
    args = ap.parse_args()
    kinds = args.kinds.split(",")
    if args.repeats < 1 or not set(kinds) <= set(KINDS):
        ap.error(f"--repeats {args.repeats} (>= 1), --kinds {args.kinds} (of {', '.join(KINDS)})")
    rows = {}
    for kind in kinds:
        runs = [measure(kind, args.flags, args.child_stderr) for _ in range(args.repeats)]
        rows[kind] = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    keys = list(rows[kinds[0]])
    print(f"XLA_FLAGS={args.flags!r}, median of {args.repeats}, CPU seconds")
    print("| step | " + " | ".join(keys) + " |")
    print("|---" * (len(keys) + 1) + "|")
    for kind, r in rows.items():
        print(f"| {kind} | " + " | ".join(f"{v:.2f}" if isinstance(v, float) else str(v) for v in r.values()) + " |")


if __name__ == "__main__":
    main()
