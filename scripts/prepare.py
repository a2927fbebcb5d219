#!/usr/bin/env python
"""`fsdp-jax prepare` as a script: the same flags and exit codes (fsdp_jax/app/cli/prepare.py)."""

import sys

from fsdp_jax.app.cli.prepare import main

if __name__ == "__main__":
    sys.exit(main())
