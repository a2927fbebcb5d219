#!/usr/bin/env python
"""Which operand dtypes the routed experts' GEMMs take on the deviceless 8 x H100 compile, per
FP8 recipe (docs/fp8.md "Routed experts").

    PYTHONPATH=. python benchmarks/fp8_expert_gemms_h100.py [--recipes rowwise delayed tensorwise] [--no-gather]

Compiles the tiny MoE of tests/test_fp8_hlo.py (6 experts, top-2, XLA's ragged_dot, d_model
128, remat dots, full_shard) for 8 compile-only H100s in one child process (the same child as
that test's fixture) under each recipe, and prints one JSON document: per recipe, the GEMM
fusions made of the experts' ragged dots by operand dtypes and direction (`bwd`: a dot named
under `transpose`), the other GEMMs by operand dtypes, the bytes the all-gathers produce
per dtype, and the expert weights' own all-gathers and gradient reduce-scatters (the arrays of
those collectives that are 3-D with a dim of n_experts) in bytes per dtype: totals over the
collectives in the program text (XLA:GPU's pipelining may peel one iteration's collective out of
the layer loop, so a program can hold more collectives than a layer runs). `--no-gather` adds each recipe with
`fp8.gather=false` (the expert weights gathered in the compute dtype, cast after). Needs the compile-only CUDA plugin (`python -m fsdp_jax.targets install`).
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

import test_fp8_hlo  # noqa: E402  (the test's child, parsers and shapes)

from fsdp_jax.targets import gpu  # noqa: E402
from helpers import TINY_MODEL_OVERRIDES  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recipes", nargs="+", default=["rowwise", "delayed", "tensorwise"])
    ap.add_argument("--no-gather", action="store_true", help="also each recipe with fp8.gather=false")
    args = ap.parse_args()
    small = [*TINY_MODEL_OVERRIDES, "model.d_model=128", "model.ffn_dim=256", "remat=dots"]
    jobs = {r: [f"precision={test_fp8_hlo.FP8}", f"fp8.recipe={r}", *test_fp8_hlo.MOE] for r in args.recipes}
    if args.no_gather:
        jobs.update({f"{r} gather=false": [*jobs[r], "fp8.gather=false"] for r in args.recipes})
    req = {"config": "configs/tiny.yaml", "small": small, "jobs": jobs}
    env = gpu.child_env(dict(os.environ, PYTHONPATH=str(ROOT)))
    proc = subprocess.run(
        [sys.executable, "-c", test_fp8_hlo._CHILD],
        input=json.dumps(req),
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
    )
    if proc.returncode != 0:
        print(f"error: the H100 compile child failed: {proc.stderr.strip().splitlines()[-1:]}", file=sys.stderr)
        return 1
    out = {}
    for recipe, text in json.loads(proc.stdout).items():
        ops = test_fp8_hlo.gemm_ops(text)
        experts = collections.Counter(
            f"{'bwd' if 'transpose' in n else 'fwd'} {' x '.join(d)}" for d, n, _ in ops if "ragged_dot" in n
        )
        others = collections.Counter(" x ".join(d) for d, n, _ in ops if "ragged_dot" not in n)
        out[recipe] = {
            "experts": dict(experts),
            "others": dict(others),
            "gathered": dict(test_fp8_hlo.gathered(text)),
            "expert_gathers": dict(test_fp8_hlo.gathered(text, experts=True)),
            "expert_grad_scatters": dict(test_fp8_hlo.gathered(text, experts=True, op="reduce-scatter")),
        }
    print(json.dumps(out, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
