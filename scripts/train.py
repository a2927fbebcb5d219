#!/usr/bin/env python
"""Train the reference Llama model with FSDP.

    python scripts/train.py --config configs/tiny.yaml [key=value ...]

On CPU the process gets 8 host devices (FSDP_JAX_CPU_DEVICES to change). Exit codes:
0 success, 2 bad input (one line on stderr naming the problem), 1 anything else.
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1].strip(),
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=20")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse printed its one-line usage error
        return 2 if e.code else 0

    import jax
    jax.config.update("jax_num_cpu_devices", int(os.environ.get("FSDP_JAX_CPU_DEVICES", "8")))
    cache = os.environ.get("FSDP_JAX_CACHE_DIR")
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)

    from fsdp_jax.cli import BAD_INPUT, fail
    from fsdp_jax.config import load_config
    from fsdp_jax.train import train

    try:
        cfg = load_config(args.config, args.overrides)
        train(cfg, progress=not args.no_progress)
    except BAD_INPUT as e:
        return fail(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
