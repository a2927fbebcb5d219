#!/usr/bin/env python
"""`fsdp-jax gpu-check` as a script: the same flags and exit codes (fsdp_jax/app/cli/gpu_check.py)."""

import sys

from fsdp_jax.app.cli.gpu_check import main

if __name__ == "__main__":
    sys.exit(main())
