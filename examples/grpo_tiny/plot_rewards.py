"""The GRPO example's curve: mean reward, completion length, entropy and KL per logged window
of a run's metrics.jsonl, as a table (stdout) and a PNG when matplotlib is installed.

    python examples/grpo_tiny/plot_rewards.py runs/grpo_tiny [--out runs/grpo_tiny/rewards.png]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEYS = ("reward", "reward_std", "completions/mean_length", "entropy", "clip_ratio/region_mean")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("run_dir")
    ap.add_argument("--out")
    a = ap.parse_args()
    rows = [json.loads(line) for line in (Path(a.run_dir) / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "reward" in r]
    print("| step | " + " | ".join(KEYS) + " |")
    print("|---" * (len(KEYS) + 1) + "|")
    for r in rows:
        print(f"| {r['step']} | " + " | ".join(f"{r.get(k, float('nan')):.4f}" for k in KEYS) + " |")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not installed: no PNG")
        return
    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    for ax, k in zip(axes, ("reward", "completions/mean_length", "entropy")):
        ax.plot(steps, [r.get(k, float("nan")) for r in rows], marker="o", markersize=3)
        ax.set_title(k)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    fig.tight_layout()
    out = Path(a.out or Path(a.run_dir) / "rewards.png")
    fig.savefig(out, dpi=100)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
