"""The step-time model against published runs: one plan per run, its prediction in the
published unit, the error (BENCHMARKS.md "Predicted step time op by op vs published runs").

    python benchmarks/step_time_published.py                    # compile every run (minutes)
    python benchmarks/step_time_published.py --only 0,1,4       # some rows (indices of PUBLISHED_RUNS)
    python benchmarks/step_time_published.py --saved DIR        # reuse DIR/<i>.json from an earlier run
    python benchmarks/step_time_published.py --fit [--only 0,5]  # the GEMM efficiencies fitted to the fit rows

Prints a markdown table (published, predicted, error, role, command) and two medians of
|error|, never pooled: over the held-out (`check`) rows, the model's accuracy, and over the
`fit` rows (~0 by construction: a constant was fitted to each).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


Planner = Callable[[list[str]], tuple[int, str, str]]  # plan's flags -> (exit code, stdout, stderr)


def plan_in_child(argv: list[str]) -> tuple[int, str, str]:
    """`python scripts/plan.py ARGV` in a fresh process, as a user runs it (the default)."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), TPU_WORKER_HOSTNAMES="localhost")
    proc = subprocess.run(
        [sys.executable, "scripts/plan.py", *argv], capture_output=True, text=True, cwd=ROOT, env=env, check=False
    )
    return proc.returncode, proc.stdout, proc.stderr


def plan_doc(i: int, run, saved: Path | None, planner: Planner = plan_in_child) -> dict:
    """The `plan --json` document for run `i` (from `saved` if it holds one), planned by `planner`
    (a child process; tests/test_step_time_published.py plans the GPU rows in its own process)."""
    from fsdp_jax.app.planner.published import plan_command

    if saved is not None and (saved / f"{i}.json").exists():
        return json.loads((saved / f"{i}.json").read_text())
    argv = shlex.split(plan_command(run))
    assert argv[:2] == ["python", "scripts/plan.py"], argv
    rc, out, err = planner(argv[2:])
    if rc != 0:
        raise SystemExit(f"run {i} ({run.name}): plan failed: {err.strip().splitlines()[-1:]}")
    if saved is not None:
        saved.mkdir(parents=True, exist_ok=True)
        (saved / f"{i}.json").write_text(out)
    return json.loads(out)


def evaluate(indices, saved: Path | None = None, planner: Planner = plan_in_child) -> list[dict]:
    """One row per run: published, predicted (its unit), error, role, fits, command."""
    from fsdp_jax.app.config import load_config
    from fsdp_jax.app.planner.published import PUBLISHED_RUNS, plan_command, predicted_value, prediction

    rows = []
    for i in indices:
        run = PUBLISHED_RUNS[i]
        doc = plan_doc(i, run, saved, planner)
        result = doc["strategies"][run.strategy]
        cfg = load_config(ROOT / run.config, list(run.overrides))
        got = predicted_value(run, cfg, result, doc["devices"])
        p = prediction(run, cfg, result, doc["devices"])
        rows.append(
            {
                "run": run.name,
                "published": run.published,
                "unit": run.unit,
                "predicted": got,
                "error": got / run.published - 1,
                "role": run.role,
                "fits": result.get("fits"),
                "step_s": p["step_s"],
                "mfu": p["mfu"],
                "above_best_mfu": p["above_best_mfu"],
                "costed": p["costed"],
                "model": p["model"],
                "source": f"{run.url} ({run.date})",
                "command": plan_command(run),
            }
        )
    return rows


def fit_gemm_efficiency(i: int, saved: Path | None = None) -> float:
    """The GEMM efficiency (`gemm.max_efficiency` of the run's cost table: `h100`'s for the GPU
    tables, the `tpu` entry's for v4 / v5e / v5p, which have no published figure; v6e has one,
    `tpu.v6e`, not fitted) at which run `i`'s predicted step equals its published figure
    (bisection; the table's value is this, rounded)."""
    import copy

    from fsdp_jax.app.config import load_config
    from fsdp_jax.app.models.decoder import count_params
    from fsdp_jax.app.planner.op_costs import simulate
    from fsdp_jax.app.planner.published import PUBLISHED_RUNS
    from fsdp_jax.targets.perf_tables import perf_table

    run = PUBLISHED_RUNS[i]
    doc = plan_doc(i, run, saved)
    cfg = load_config(ROOT / run.config, list(run.overrides))
    m, tokens = cfg.model, cfg.data.seq_len * cfg.train.global_batch / doc["devices"]
    if run.unit == "tokens_per_s":
        want_s = tokens / run.published
    else:  # maxtext_tflops: their count, 6 x params + 12 L d S per token
        per_token = 6 * count_params(m) + 12 * m.n_layers * m.d_model * cfg.data.seq_len
        want_s = tokens * per_token / (run.published * 1e12)
    lo, hi = 0.2, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        t = copy.deepcopy(perf_table(run.cost_target))
        t["gemm"]["max_efficiency"] = mid
        step = simulate(doc["strategies"][run.strategy]["op_inventory"], t)["step_s"]
        lo, hi = (mid, hi) if step > want_s else (lo, mid)
    return (lo + hi) / 2


def medians(rows: list[dict]) -> dict[str, float | None]:
    """Median |error| per role: "check" (held out: the headline) and "fit" (fitted, ~0 by
    construction), never pooled; None for a role with no row."""
    out: dict[str, float | None] = {}
    for role in ("check", "fit"):
        errs = [abs(r["error"]) for r in rows if r["role"] == role]
        out[role] = statistics.median(errs) if errs else None
    return out


def main(argv=None) -> int:
    from fsdp_jax.app.planner.published import PUBLISHED_RUNS, TOLERANCE

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=None, help="comma list of run indices")
    ap.add_argument("--saved", default=None, help="folder of plan JSONs to reuse / fill")
    ap.add_argument(
        "--fit", action="store_true", help="print the GEMM efficiency fitted to each fit row (GPU, TPU), and stop"
    )
    args = ap.parse_args(argv)
    if args.fit:
        for i, r in enumerate(PUBLISHED_RUNS):
            if r.role == "fit" and (args.only is None or str(i) in args.only.split(",")):
                eff = fit_gemm_efficiency(i, args.saved and Path(args.saved))
                print(f"gemm.max_efficiency ({r.cost_target} table) fitted to row {i}, {r.name}: {eff:.4f}")
        return 0
    idx = range(len(PUBLISHED_RUNS)) if args.only is None else [int(x) for x in args.only.split(",")]
    rows = evaluate(idx, Path(args.saved) if args.saved else None)
    unit = {"maxtext_tflops": "TFLOP/s/GPU (MaxText's count)", "tokens_per_s": "tokens/s/device"}
    print("| run | role | published | predicted | error | MFU | fits | costed | source | command |")
    print("|---|---|---:|---:|---:|---:|---|---|---|---|")
    for r in rows:
        costed = "; ".join(r["costed"].values()) + (
            "" if r["model"] == "ops" else " (roofline: the compile was refused)"
        )
        print(
            f"| {r['run']} | {r['role']} | {r['published']:,.0f} {unit[r['unit']]} | {r['predicted']:,.0f} | "
            f"{r['error']:+.1%} | {r['mfu']:.1%} | {r['fits']} | {costed} | {r['source']} | `{r['command']}` |"
        )
    med = medians(rows)
    n = {role: sum(r["role"] == role for r in rows) for role in ("check", "fit")}
    if med["check"] is not None:
        print(
            f"\nheld-out median |error| ({n['check']} check rows): {med['check']:.1%} (tolerance {TOLERANCE:.0%} each)"
        )
    if med["fit"] is not None:
        print(f"fitted median |error| ({n['fit']} fit rows, ~0 by construction): {med['fit']:.1%}")
    for r in rows:
        if r.get("above_best_mfu"):
            print(f"warning: {r['run']}: {r['above_best_mfu']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
