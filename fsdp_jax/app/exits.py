"""Exit codes of every command: which errors are the user's input (one line on stderr,
exit code 2) and which are the environment's (one line, exit code 1). The wrapper that
applies them is `fsdp_jax.app.cli.command.run_command`.

Importing this module imports the error classes, hence JAX: commands import it after
their flags are parsed, so `--help` and a bad flag stay fast.
"""

from __future__ import annotations

import os
import sys

from fsdp_jax.checkpoint import CheckpointError, CheckpointWriteError
from fsdp_jax.errors import (
    BatchError,
    ConfigError,
    DataError,
    DistributedInitError,
    MeshError,
    RewardError,
    RewardFailed,
    RunDirBusy,
    ShardingError,
    StateError,
    XlaFlagsError,
    one_line,
)

BAD_INPUT: tuple[type[BaseException], ...] = (
    ConfigError,
    DataError,
    MeshError,
    ShardingError,
    BatchError,
    CheckpointError,
    StateError,
    FileNotFoundError,
    XlaFlagsError,
    RewardError,
)

# Failures of the environment, not of the input: one line on stderr, exit code 1.
ENVIRONMENT: tuple[type[BaseException], ...] = (
    CheckpointWriteError,
    RunDirBusy,
    DistributedInitError,
    OSError,
    RewardFailed,
)


def fail(e: BaseException) -> int:
    """Print `error: <one line>` to stderr and return exit code 2."""
    print(f"error: {one_line(e, None)}", file=sys.stderr, flush=True)
    return 2


def fail_env(e: BaseException) -> int:
    """Print `error: <one line>` to stderr and return exit code 1."""
    print(f"error: {one_line(e, None)}", file=sys.stderr, flush=True)
    return 1


def fail_internal(e: BaseException) -> int:
    """Anything else (a bug, or the device running out of memory): one line and exit
    code 1; FSDP_JAX_TRACEBACK=1 re-raises for the full traceback."""
    if os.environ.get("FSDP_JAX_TRACEBACK"):
        raise e
    msg = one_line(e, 400) if str(e).strip() else ""
    hint = "" if "RESOURCE_EXHAUSTED" in msg else " (FSDP_JAX_TRACEBACK=1 shows the traceback)"
    print(f"error: {type(e).__name__}: {msg}{hint}", file=sys.stderr, flush=True)
    return 1
