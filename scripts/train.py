#!/usr/bin/env python
"""`fsdp-jax train` as a script: the same flags and exit codes (fsdp_jax/app/cli/train.py)."""

import os
import sys

# scripts/ comes first on sys.path, where scripts/inspect.py would stand in for the stdlib's `inspect`
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != os.path.dirname(os.path.abspath(__file__))]
from fsdp_jax.app.cli.train import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
