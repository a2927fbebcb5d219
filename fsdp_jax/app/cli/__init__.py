"""The command line: `fsdp-jax <command>` (installed by `[project.scripts]`) and the
`scripts/*.py` shims over the same commands.

    flags     the one parser (`Parser`: errors are one line, exit code 2) and number types
    args      argument groups the commands share (config + overrides, target + hosts, devices)
    exits     which errors are bad input (exit 2) or the environment (exit 1)
    command   `run_command`: the one main wrapper (parse, run, map errors to exit codes)
    devices   `use_cpu_devices`: the CPU devices and compilation cache of a command's process
    entry     the `fsdp-jax` dispatcher and the table of commands
    <command> one module per command (train, plan, inspect_sharding, verify, ...), each with
              `build_parser(prog)` and `main(argv, prog)`

This package imports nothing heavy: the names of `exits` (which import the error classes,
hence JAX) load when first used, so `from fsdp_jax.app.cli import BAD_INPUT` still works.
"""

from __future__ import annotations

import importlib

_LAZY = {
    "BAD_INPUT": "exits",
    "ENVIRONMENT": "exits",
    "fail": "exits",
    "fail_env": "exits",
    "fail_internal": "exits",
    "run_command": "command",
    "use_cpu_devices": "devices",
    "env_int": "devices",
    "require": "args",
    "check_out_file": "args",
    "Parser": "flags",
    "int_in": "flags",
    "real_in": "flags",
}

__all__ = [
    "BAD_INPUT",
    "ENVIRONMENT",
    "Parser",
    "check_out_file",
    "env_int",
    "fail",
    "fail_env",
    "fail_internal",
    "int_in",
    "real_in",
    "require",
    "run_command",
    "use_cpu_devices",
]


def __getattr__(name: str):
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
