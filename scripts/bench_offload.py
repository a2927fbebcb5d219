#!/usr/bin/env python
"""`fsdp-jax bench-offload` as a script: the same flags and exit codes (fsdp_jax/app/cli/bench_offload.py)."""

import sys

from fsdp_jax.app.cli.bench_offload import main

if __name__ == "__main__":
    sys.exit(main())
