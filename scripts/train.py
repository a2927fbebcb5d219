#!/usr/bin/env python
"""`fsdp-jax train` as a script: the same flags and exit codes (fsdp_jax/app/cli/train.py)."""

import sys

from fsdp_jax.app.cli.train import main

if __name__ == "__main__":
    sys.exit(main())
