"""Shared command-line conventions: which errors are the user's input, and how
they are reported (one line on stderr, exit code 2)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from fsdp_jax.checkpoint import CheckpointError, CheckpointWriteError
from fsdp_jax.app.config import ConfigError
from fsdp_jax.app.data import DataError, dir_problem
from fsdp_jax.app.run_dir import RunDirBusy
from fsdp_jax.distributed import DistributedInitError
from fsdp_jax.mesh import MeshError
from fsdp_jax.model_state import StateError
from fsdp_jax.rules import ShardingError
from fsdp_jax.step import BatchError
from fsdp_jax.xla_flags import XlaFlagsError, check_xla_flags

BAD_INPUT: tuple[type[BaseException], ...] = (ConfigError, DataError, MeshError, ShardingError,
                                               BatchError, CheckpointError, StateError,
                                               FileNotFoundError, XlaFlagsError)


def fail(e: BaseException) -> int:
    """Print `error: <one line>` to stderr and return exit code 2."""
    msg = " ".join(str(e).split()) or type(e).__name__
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return 2


# Failures of the environment, not of the input: one line on stderr, exit code 1.
ENVIRONMENT: tuple[type[BaseException], ...] = (CheckpointWriteError, RunDirBusy, DistributedInitError,
                                                OSError)


def fail_env(e: BaseException) -> int:
    """Print `error: <one line>` to stderr and return exit code 1."""
    msg = " ".join(str(e).split()) or type(e).__name__
    print(f"error: {msg}", file=sys.stderr, flush=True)
    return 1


def fail_internal(e: BaseException) -> int:
    """Anything else (a bug, or the device running out of memory): one line and exit
    code 1; FSDP_JAX_TRACEBACK=1 re-raises for the full traceback."""
    if os.environ.get("FSDP_JAX_TRACEBACK"):
        raise e
    msg = " ".join(str(e).split())
    hint = "" if "RESOURCE_EXHAUSTED" in msg else " (FSDP_JAX_TRACEBACK=1 shows the traceback)"
    print(f"error: {type(e).__name__}: {msg[:400]}{hint}", file=sys.stderr, flush=True)
    return 1


def env_int(name: str, default: int, low: int = 1, high: int = 1 << 16) -> int:
    """An integer environment variable in [low, high] (`default` when unset or empty);
    ConfigError naming the variable otherwise."""
    text = os.environ.get(name, "").strip()
    if not text:
        return default
    try:
        v = int(text)
    except ValueError:
        v = low - 1
    if not low <= v <= high:
        raise ConfigError(name, f"{os.environ[name]!r} is invalid; expected an integer in {low}..{high}")
    return v


def use_cpu_devices(env: str = "FSDP_JAX_CPU_DEVICES", default: int = 8) -> int:
    """Give this process `$env` (default 8) CPU host devices. JAX takes the setting only
    before its backends start; when they already run with that count (main() called from a
    notebook or a test), nothing is changed. ConfigError names `env` when it is not a count;
    XlaFlagsError names an XLA_FLAGS entry XLA would abort the process over."""
    import jax
    check_xla_flags()
    n = env_int(env, default)
    if jax.config.jax_num_cpu_devices != n:
        jax.config.update("jax_num_cpu_devices", n)
    return n


def require(module: str, flag: str) -> None:
    """ConfigError naming `flag` when the optional package `module` is not installed."""
    from fsdp_jax.app.extras import available, missing_message
    if not available(module):
        raise ConfigError(flag, missing_message(module, "it").removeprefix("it "))


def check_out_file(path: str, flag: str) -> None:
    """ConfigError naming `flag` unless `path` can be written as a file: not a
    directory, in an existing, writable directory. Writes nothing."""
    p = Path(path).absolute()
    if p.is_dir():
        raise ConfigError(flag, f"{path!r} is a directory; give a file path")
    if not p.parent.is_dir():
        raise ConfigError(flag, f"{path!r}: its directory {str(p.parent)!r} does not exist")
    problem = dir_problem(p.parent)
    if problem or (p.exists() and not os.access(p, os.W_OK)):
        raise ConfigError(flag, f"{path!r} is not writable; choose a writable place")
