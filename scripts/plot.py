#!/usr/bin/env python
"""`fsdp-jax plot` as a script: the same flags and exit codes (fsdp_jax/app/cli/plot.py)."""

import sys

from fsdp_jax.app.cli.plot import main

if __name__ == "__main__":
    sys.exit(main())
