#!/usr/bin/env python
"""`fsdp-jax measure-hf-import` as a script: the same flags and exit codes (fsdp_jax/app/cli/measure_hf_import.py)."""

import sys

from fsdp_jax.app.cli.measure_hf_import import main

if __name__ == "__main__":
    sys.exit(main())
