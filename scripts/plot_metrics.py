#!/usr/bin/env python
"""Plot a run's train/val loss and tokens/s from RUN_DIR/metrics.jsonl.

    python scripts/plot_metrics.py RUN_DIR [--out RUN_DIR/metrics.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line on stderr, exit code 2."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def read_metrics(path: Path) -> list[dict]:
    records = []
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path}: not a UTF-8 text file") from None
    for i, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i}: not JSON ({e.msg})") from None
            if not isinstance(rec, dict) or not isinstance(rec.get("step"), int):
                raise ValueError(f"{path}:{i}: not a metrics record (an object with an integer step)")
            records.append(rec)
    return records


def _num(v) -> float:
    """A logged value; null (a non-finite value, see "nonfinite") plots as a gap."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) else float("nan")


def plot(records: list[dict], out: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    train = [r for r in records if "loss" in r]
    val = [r for r in records if "val_loss" in r]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    ax1.plot([r["step"] for r in train], [_num(r["loss"]) for r in train], label="train")
    if val:
        ax1.plot([r["step"] for r in val], [_num(r["val_loss"]) for r in val], "o-", label="validation")
    ax1.set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    ax1.legend()
    ax1.grid(alpha=0.3)
    ax2.plot([r["step"] for r in train], [r.get("tokens_per_s") or 0 for r in train])
    ax2.set(xlabel="step", ylabel="tokens/s", title="throughput")
    ax2.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(out, dpi=100)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description="Plot RUN_DIR/metrics.jsonl")
    ap.add_argument("run_dir")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    path = Path(args.run_dir) / "metrics.jsonl"
    if not path.is_file():
        print(f"error: {path}: no metrics file (is {args.run_dir} a run directory?)", file=sys.stderr)
        return 2
    try:
        records = read_metrics(path)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not any("loss" in r for r in records):
        print(f"error: {path}: no logged training steps yet", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else Path(args.run_dir) / "metrics.png"
    if out.is_dir() or not out.absolute().parent.is_dir() or not os.access(out.absolute().parent, os.W_OK):
        print(f"error: --out {str(out)!r}: not a writable file path (a directory, or its directory "
              "is missing or read-only)", file=sys.stderr)
        return 2
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("error: plotting needs the matplotlib package (pip install matplotlib)", file=sys.stderr)
        return 2
    plot(records, out)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
