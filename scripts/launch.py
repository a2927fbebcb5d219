#!/usr/bin/env python
"""`fsdp-jax launch` as a script: the same flags and exit codes (fsdp_jax/app/cli/launch.py)."""

import sys

from fsdp_jax.app.cli.launch import main

if __name__ == "__main__":
    sys.exit(main())
