#!/usr/bin/env python
"""`fsdp-jax verify` as a script: the same flags and exit codes (fsdp_jax/app/cli/verify.py)."""

import sys

from fsdp_jax.app.cli.verify import main

if __name__ == "__main__":
    sys.exit(main())
