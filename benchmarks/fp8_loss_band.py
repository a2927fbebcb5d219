#!/usr/bin/env python
"""The tiny model's loss under FP8 emulation against bf16, on the same batches.

    PYTHONPATH=. python benchmarks/fp8_loss_band.py [--steps 500] [--devices 1] [--jobs 1] \
        [--out benchmarks/fp8_loss_band.json] [--plot benchmarks/fp8_loss_band.png]

Trains configs/tiny.yaml with `scripts/train.py` (same seed, data and schedule):
precision params=float32,compute=bfloat16 (the reference), and the same with matmul=fp8
under the tensorwise, the delayed (amax history 16) and the rowwise recipes,
fp8.emulate=true (CPU); `--runs` picks some of them (bf16 always runs), `--jobs` runs that
many at once (each its own process), `--work DIR` keeps the run folders, and `--read --work DIR`
reports runs that are still going or were stopped, over the 50-step windows all of them
finished (`steps` in the report says how far that is). Reads each run's metrics.jsonl and reports, per FP8 run, the largest gap to bf16 of
the training loss averaged over windows of 50 steps (single steps are noisy), the final
window's gap and the final validation losses. The band asserted in docs/fp8.md is the
largest windowed gap, relative to bf16's loss. Prints one JSON document (also --out).
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RUNS = {
    "bf16": ["precision=params=float32,compute=bfloat16"],
    "fp8_tensorwise": ["precision=params=float32,compute=bfloat16,matmul=fp8", "fp8.recipe=tensorwise"],
    "fp8_delayed": ["precision=params=float32,compute=bfloat16,matmul=fp8", "fp8.recipe=delayed"],
    "fp8_rowwise": ["precision=params=float32,compute=bfloat16,matmul=fp8", "fp8.recipe=rowwise"],
}
WINDOW = 50


def run(name: str, extra: list[str], steps: int, devices: int, work: Path) -> list[dict]:
    run_dir = work / name
    cmd = [sys.executable, str(ROOT / "scripts/train.py"), "--config", str(ROOT / "configs/tiny.yaml")]
    cmd += [
        f"train.steps={steps}",
        "train.eval_every=100",
        "train.log_every=5",
        "train.checkpoint_every=0",
        "train.sample_tokens=0",
    ]
    # each run prepares its own copy of the default corpus (the same bytes): runs may go at once
    cmd += [f"run_dir={run_dir}", f"data.path={work / ('data-' + name)}", "fp8.emulate=true", *extra]
    env = dict(os.environ, FSDP_JAX_CPU_DEVICES=str(devices), PYTHONPATH=str(ROOT))
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    return read(run_dir)


def read(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def windows(records: list[dict]) -> dict[int, float]:
    """Mean training loss per window of WINDOW steps (keyed by the window's last step)."""
    out: dict[int, list[float]] = {}
    for r in records:
        if "loss" in r and "step" in r:
            out.setdefault((int(r["step"]) - 1) // WINDOW, []).append(float(r["loss"]))
    return {(k + 1) * WINDOW: sum(v) / len(v) for k, v in sorted(out.items())}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=500)
    ap.add_argument("--devices", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1)
    ap.add_argument("--out", default=None)
    ap.add_argument("--plot", default=None)
    ap.add_argument("--runs", nargs="+", choices=[n for n in RUNS if n != "bf16"], default=None)
    ap.add_argument("--work", default=None, help="keep the run folders here (default: a temporary folder)")
    ap.add_argument("--read", action="store_true", help="train nothing: report the runs in --work as far as all got")
    args = ap.parse_args()
    names = ["bf16", *(args.runs or [n for n in RUNS if n != "bf16"])]
    if args.read:
        recs = {name: read(Path(args.work) / name) for name in names}
    else:
        with tempfile.TemporaryDirectory() as tmp, concurrent.futures.ThreadPoolExecutor(max(1, args.jobs)) as pool:
            work = Path(args.work) if args.work else Path(tmp)
            work.mkdir(parents=True, exist_ok=True)
            futures = {name: pool.submit(run, name, RUNS[name], args.steps, args.devices, work) for name in names}
            recs = {name: f.result() for name, f in futures.items()}
    # runs cut short (--read): only the windows every run finished
    args.steps = min(args.steps, *(max(int(r["step"]) for r in rs if "loss" in r) for rs in recs.values()))
    curves = {name: {s: v for s, v in windows(r).items() if s <= args.steps} for name, r in recs.items()}
    val = {name: [r["val_loss"] for r in rs if "val_loss" in r] for name, rs in recs.items()}
    ref = curves["bf16"]
    report = {"steps": args.steps, "devices": args.devices, "window": WINDOW, "curves": curves, "val_loss": val}
    for name in names:
        if name == "bf16":
            continue
        gaps = {s: (curves[name][s] - ref[s]) / ref[s] for s in ref if s in curves[name]}
        if not gaps:  # --read before any window finished
            report[name] = {"max_rel_gap": None, "final_rel_gap": None}
            continue
        last = max(gaps)
        report[name] = {"max_rel_gap": max(abs(g) for g in gaps.values()), "final_rel_gap": gaps[last]}
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")
    if args.plot:
        import matplotlib  # optional: only for --plot

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6, 4))
        for name, rs in recs.items():
            pts = [(r["step"], r["loss"]) for r in rs if "loss" in r and "step" in r]
            ax.plot(*zip(*pts), label=name, lw=1)
        ax.set_xlabel("step")
        ax.set_ylabel("train loss (nats/byte)")
        ax.set_title(f"tiny model, bf16 vs FP8 (emulated), {args.devices} device(s)")
        ax.legend()
        fig.tight_layout()
        fig.savefig(args.plot, dpi=100)


if __name__ == "__main__":
    main()
