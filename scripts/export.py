#!/usr/bin/env python
"""`fsdp-jax export` as a script: the same flags and exit codes (fsdp_jax/app/cli/export.py)."""

import sys

from fsdp_jax.app.cli.export import main

if __name__ == "__main__":
    sys.exit(main())
