"""Process start-up for a command: the CPU devices JAX gives this process, and the
persistent compilation cache. Import-light (JAX is imported inside)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

import jax
from jax.experimental.compilation_cache import compilation_cache

from fsdp_jax.errors import ConfigError
from fsdp_jax.targets.xla_flags import check_xla_flags

ENV_DEVICES = "FSDP_JAX_CPU_DEVICES"
ENV_CACHE = "FSDP_JAX_CACHE_DIR"


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


def use_cpu_devices(n: int | None = None, *, env: str = ENV_DEVICES, default: int = 8) -> int:
    """Before JAX starts its backends: give the CPU backend (only; other backends keep their
    devices) `n` devices, or `$env` (default 8) when `n` is None, and use the compilation
    cache in $FSDP_JAX_CACHE_DIR when it is set. Returns the count.

    JAX takes the count only before its backends start; when they already run (main()
    called from a notebook or a test), nothing is changed. ConfigError names
    `env` when it is not a count; XlaFlagsError names an XLA_FLAGS entry XLA would abort
    the process over (`fsdp_jax.targets.xla_flags.check_xla_flags`)."""

    check_xla_flags()
    if n is None:
        n = env_int(env, default)
    if jax.config.jax_num_cpu_devices != n:
        try:
            jax.config.update("jax_num_cpu_devices", n)
        except RuntimeError:  # backends already started (a notebook, a test): they keep their
            pass  # count; the planner compiles for n devices in a child process then
    cache = os.environ.get(ENV_CACHE)
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
    return n


@contextlib.contextmanager
def without_compilation_cache() -> Iterator[None]:
    """Compiles inside neither read nor write JAX's persistent compilation cache: a benchmark's
    compile times are cold ones, and a compile asked to dump its HLO (`xla_dump_to`) compiles.
    JAX reads `jax_enable_compilation_cache` once, at a process's first compile, so after one the
    setting alone changes nothing (a program the cache holds is still read from it): the cache's
    state is reset on the way in and out, and the setting restored."""

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    compilation_cache.reset_cache()
    try:
        yield
    finally:
        jax.config.update("jax_enable_compilation_cache", was)
        compilation_cache.reset_cache()
