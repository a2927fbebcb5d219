#!/usr/bin/env python
"""`fsdp-jax benchmark` as a script: the same flags and exit codes (fsdp_jax/app/cli/benchmark.py)."""

import sys

from fsdp_jax.app.cli.benchmark import main

if __name__ == "__main__":
    sys.exit(main())
