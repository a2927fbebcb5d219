#!/usr/bin/env python
"""Export a run's params as one consolidated safetensors file.

    python scripts/export.py RUN_DIR --out model.safetensors [--dtype bfloat16] [--step N]

RUN_DIR is a train run directory (its checkpoints/ is used) or a checkpoint
directory. Keys are slash-separated param paths ("blocks/attn/wq"); stacked layers
keep their leading layer dim. Leaves are read one at a time into host memory (the
optimizer state is never read), so no accelerator is needed. The newest checkpoint
that passes its manifest check is used unless --step is given. Train from the file
with `init_from=model.safetensors`. Exit codes: 0 success, 2 bad input (one line on
stderr), 1 anything else.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line on stderr, exit code 2."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


DTYPES = ("float32", "bfloat16", "float16")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description=__doc__.splitlines()[1].strip(),
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("run_dir", help="train run directory or checkpoint directory")
    ap.add_argument("--out", required=True, help="output .safetensors file")
    ap.add_argument("--dtype", choices=DTYPES, default=None,
                    help="cast floating-point params (default: as saved)")
    ap.add_argument("--step", type=int, default=None, help="checkpoint step (default: newest)")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse printed its one-line usage error
        return 2 if e.code else 0

    import os

    from fsdp_jax.checkpoint import CheckpointError, export_safetensors
    from fsdp_jax.app.cli import BAD_INPUT, ENVIRONMENT, fail, fail_env

    run_dir = Path(args.run_dir)
    directory = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    out = Path(args.out)
    try:
        if not directory.is_dir():
            raise CheckpointError(f"{run_dir}: no such run or checkpoint directory")
        if out.is_dir():
            raise CheckpointError(f"--out {args.out}: is a directory; give a file path, e.g. "
                                  f"{out / 'model.safetensors'}")
        if not out.absolute().parent.is_dir():
            raise CheckpointError(f"--out {args.out}: its directory does not exist")
        if not os.access(out.absolute().parent, os.W_OK | os.X_OK) or (
                out.exists() and not os.access(out, os.W_OK)):
            raise CheckpointError(f"--out {args.out}: not writable here; choose a writable place")
        if args.step is not None and args.step < 0:
            raise CheckpointError(f"--step {args.step}: must be >= 0")
        info = export_safetensors(directory, out, dtype=args.dtype, step=args.step)
    except BAD_INPUT as e:
        return fail(e)
    except ENVIRONMENT as e:  # e.g. the disk filled up while writing: no partial file is left
        return fail_env(e)
    print(f"exported step {info['step']}: {info['tensors']} tensors, {info['bytes'] / 2**20:.2f} MiB "
          f"-> {info['path']}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
