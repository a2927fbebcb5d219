"""Argument groups the commands share, and checks of flag values that need no JAX.

ap = Parser(...)
add_config(ap)          # --config FILE + trailing dotted key=value overrides
add_target(ap)          # --devices, --target, --hosts, --slices, --topology, --tpu-flags
add_devices(ap, "8")    # --devices alone
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from fsdp_jax.app import extras
from fsdp_jax.app.config.early_checks import check_before_jax
from fsdp_jax.app.config.read import read_config
from fsdp_jax.app.data.writable import dir_problem
from fsdp_jax.errors import ConfigError


def add_config(
    ap: argparse.ArgumentParser, *, required: bool = True, default: str | None = None, example: str = "train.steps=20"
) -> None:
    """`--config FILE` (a YAML config) and the trailing `key=value` overrides (`overrides`)."""
    ap.add_argument(
        "--config",
        required=required,
        default=default,
        help="YAML config (configs/*.yaml)" + (f"; default {default}" if default else ""),
    )
    ap.add_argument("overrides", nargs="*", help=f"dotted key=value overrides, e.g. {example}")


def config_before_jax(args: argparse.Namespace) -> None:
    """`run_command`'s `before` for a command with `add_config`: its config file, YAML,
    overrides, unknown keys and each value's type, limits and choices (`read_config`), so
    such a refusal comes before JAX loads. Returns None: the body reads the config again,
    whole (checks across fields, the Hugging Face fill), as it always did."""
    if args.config is not None:
        read_config(args.config, args.overrides)


def config_agrees_before_jax(args: argparse.Namespace) -> None:
    """`config_before_jax`, then the checks across the config's fields that need no JAX
    (`fsdp_jax.app.config.early_checks.check_before_jax`: heads, decoder, MoE, data fields,
    run_dir, mesh, remat, offload, distributed, precision, train, MTP, FP8, cuDNN attention's
    compute dtype), the start of the body's `checks.validate`. A command whose body checks
    flags first calls it after its own flag checks that need no JAX. Skipped for
    `init_from=hf:PATH` (the model section is filled after JAX)."""
    cfg = None if args.config is None else read_config(args.config, args.overrides)
    if cfg is not None:
        check_before_jax(cfg)


def add_devices(ap: argparse.ArgumentParser, default: str | None = None, text: str | None = None) -> None:
    """`--devices N` (checked later by `fsdp_jax.app.planner.flag_values.parse_devices`); `text`: its help."""
    ap.add_argument("--devices", default=default, help=text or f"number of devices (default {default})")


def add_target(ap: argparse.ArgumentParser) -> None:
    """The device and target flags of plan and inspect (read by
    `fsdp_jax.app.planner.inputs.resolve_target`)."""
    add_devices(ap, text="number of devices (with a TPU accelerator type or --topology: implied)")
    ap.add_argument(
        "--target",
        default=None,
        help="compile for this accelerator instead of CPU: a GPU (h100, h200, a100; PCIe cards rtx4090, rtx3090, l4, l40s, a10g), a rented cluster "
        "(a3-high, a3-mega, p5, ndr-h100, ndr-h200: its network costs the plan), a TPU "
        "generation (v4, v5e, v5p, v6e) or accelerator type (v5p-64, v6e-256); plan --list-targets lists them",
    )
    ap.add_argument("--hosts", default=None, help="with a GPU --target: hosts the devices are spread over (default 1)")
    ap.add_argument(
        "--slices",
        default=None,
        help="with a TPU --target: slices over the data-center network (default 1; "
        "hybrid_shard puts data across them, fsdp within one)",
    )
    ap.add_argument("--topology", default=None, help="with a TPU --target: one slice's shape, e.g. 2x4x4 or 16x16")
    ap.add_argument(
        "--tpu-flags",
        default=None,
        help="with a TPU --target: compile with a published run's libtpu flags (a set of "
        "fsdp_jax/targets/tpu_flags.json, e.g. maxtext-llama2-70b-v5p; your LIBTPU_INIT_ARGS win)",
    )


def require(module: str, flag: str) -> None:
    """ConfigError naming `flag` when the optional package `module` is not installed."""

    if not extras.available(module):
        raise ConfigError(flag, extras.missing_message(module, "it").removeprefix("it "))


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
