"""Shared command-line conventions: which errors are the user's input, and how
they are reported (one line on stderr, exit code 2)."""

from __future__ import annotations

import sys

from fsdp_jax.checkpoint import CheckpointError
from fsdp_jax.app.config import ConfigError
from fsdp_jax.app.data import DataError
from fsdp_jax.mesh import MeshError
from fsdp_jax.rules import ShardingError
from fsdp_jax.step import BatchError

BAD_INPUT: tuple[type[BaseException], ...] = (ConfigError, DataError, MeshError, ShardingError,
                                               BatchError, CheckpointError, FileNotFoundError)


def fail(e: BaseException) -> int:
    """Print `error: <one line>` to stderr and return exit code 2."""
    msg = " ".join(str(e).split()) or type(e).__name__
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return 2
