#!/usr/bin/env python
"""`fsdp-jax convert` as a script: the same flags and exit codes (fsdp_jax/app/cli/convert.py)."""

import sys

from fsdp_jax.app.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
