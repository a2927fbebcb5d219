"""Plot a run's train/val loss, tokens/s and where the wall time went (the step-time
breakdown per logged window, and the goodput of each run segment) from
RUN_DIR/metrics.jsonl (`fsdp_jax.app.trainer.plot`).

    fsdp-jax plot RUN_DIR [--out RUN_DIR/metrics.png]
    python scripts/plot.py RUN_DIR [--out RUN_DIR/metrics.png]

Needs matplotlib (pip install 'fsdp_jax[plot]'). Exit codes: 0 success, 2 bad input (one
line on stderr), 1 anything else.
"""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser
from fsdp_jax.app.trainer.plot import plot, read_metrics
from fsdp_jax.errors import UsageError


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    ap.add_argument("run_dir")
    ap.add_argument("--out", help="PNG path (default RUN_DIR/metrics.png)")
    return ap


def run(args) -> int:

    path = Path(args.run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise UsageError(f"{path}: no metrics file (is {args.run_dir} a run directory?)")
    try:
        records = read_metrics(path)
    except ValueError as e:
        raise UsageError(str(e)) from None
    if not any("loss" in r for r in records):
        raise UsageError(f"{path}: no logged training steps yet")
    out = Path(args.out) if args.out else Path(args.run_dir) / "metrics.png"
    if out.is_dir() or not out.absolute().parent.is_dir() or not os.access(out.absolute().parent, os.W_OK):
        raise UsageError(
            f"--out {str(out)!r}: not a writable file path (a directory, or its directory is missing or read-only)"
        )
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        from fsdp_jax.app.extras import missing_message

        raise UsageError(missing_message("matplotlib", "plotting")) from None
    plot(records, out)
    print(out)
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), run, argv)
