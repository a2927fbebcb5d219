#!/usr/bin/env python
"""`fsdp-jax inspect` as a script: the same flags and exit codes (fsdp_jax/app/cli/inspect_sharding.py)."""

import sys

from fsdp_jax.app.cli.inspect_sharding import main

if __name__ == "__main__":
    sys.exit(main())
