#!/usr/bin/env python
"""`fsdp-jax plan` as a script: the same flags and exit codes (fsdp_jax/app/cli/plan.py)."""

import sys

from fsdp_jax.app.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
