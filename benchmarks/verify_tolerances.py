#!/usr/bin/env python
"""Measure how far healthy models drift from one device under each strategy: the data
behind `fsdp_jax.TOLERANCES` (fsdp_jax/verify/report.py).

    PYTHONPATH=$PWD JAX_PLATFORMS=cpu python benchmarks/verify_tolerances.py [--steps 5]

For the reference decoder (tests/helpers.py TINY: d_model 64, 2 layers) and the Linen and
NNX MLPs of tests/test_verify.py, with SGD (momentum 0.9) and AdamW, in f32 and with
bf16 compute: `verify` over all five strategies on 8 CPU devices with no limits, and
the largest loss / grad-norm / per-leaf param relative difference over strategies and
steps. Writes benchmarks/verify_tolerances.json and prints a markdown table.
"""

import argparse
import json
import pathlib
import sys

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
jax.config.update("jax_num_cpu_devices", 8)

import optax  # noqa: E402
from test_verify import classification_batches, linen_setup, nnx_setup  # noqa: E402

import fsdp_jax as fj  # noqa: E402
from helpers import tiny_llama, token_batches  # noqa: E402

NO_LIMIT = fj.Tolerance("measure", float("inf"), float("inf"), float("inf"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    args = ap.parse_args()
    models = {
        "llama": (*tiny_llama(), token_batches(args.steps)),
        "linen_mlp": (*linen_setup(), classification_batches(args.steps)),
        "nnx_mlp": (*nnx_setup(reg="pmean"), classification_batches(args.steps)),
    }
    opts = {"sgd": optax.sgd(0.1, momentum=0.9), "adamw": optax.adamw(3e-3)}
    rows = []
    for mname, (model, loss_fn, batches) in models.items():
        for oname, opt in opts.items():
            for prec in ("f32", "bf16"):
                r = fj.verify(
                    model,
                    opt,
                    loss_fn,
                    batches=batches,
                    devices=8,
                    steps=args.steps,
                    min_shard_size=1,
                    check_init=False,
                    tolerance=NO_LIMIT,
                    precision="params=float32,compute=bfloat16" if prec == "bf16" else None,
                )
                s = r.strategies.values()
                rows.append(
                    {
                        "model": mname,
                        "optimizer": oname,
                        "compute": prec,
                        "loss_rel": max(x.max_loss_rel_diff for x in s),
                        "grad_norm_rel": max(max(x.grad_norm_rel_diff) for x in s),
                        "param_rel": max(max(x.param_rel_diff) for x in s),
                        "param_abs": max(x.param_max_abs_diff for x in s),
                    }
                )
                print(rows[-1], flush=True)
    (ROOT / "benchmarks" / "verify_tolerances.json").write_text(json.dumps(rows, indent=1) + "\n")
    print("| model | optimizer | compute | loss rel | grad-norm rel | param rel (leaf, Frobenius) | param max abs |")
    print("|---|---|---|---|---|---|---|")
    for x in rows:
        print(
            f"| {x['model']} | {x['optimizer']} | {x['compute']} | {x['loss_rel']:.1e} | "
            f"{x['grad_norm_rel']:.1e} | {x['param_rel']:.1e} | {x['param_abs']:.1e} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
