"""What a user types in: device counts, memory sizes and strategy lists as the scripts
take them, their check against the config, and the scripts' start-up.

    mem = parse_bytes("80GB")                      # sizes as GPU vendors quote them
    names = parse_strategies("ddp,zero3")          # canonical strategy names
    n, target = resolve_target(args)               # the device count and Target from the flags

Bad input raises `PlanError`, whose message names the flag. `load_planning_config` is the
scripts' start-up: the config, then JAX on N CPU devices. What the user reads back (the
warnings, tables, plot and inspection) is `fsdp_jax.app.planner.report`, which re-exports
these names.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from fsdp_jax.app.config.checks import validate
from fsdp_jax.app.config.fp8_checks import check_fp8_device
from fsdp_jax.app.devices import use_cpu_devices
from fsdp_jax.app.planner.flag_values import devices_without_target, parse_devices
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.errors import PlanError
from fsdp_jax.sharding.strategy import get_strategy
from fsdp_jax.targets.gpu import make_target
from fsdp_jax.targets.tpu_flags import flag_set

CLASSIC_NAMES = {  # the classic table's names, in `flag_values.STRATEGY_ORDER`
    "no_shard": "DDP",
    "shard_opt": "ZeRO-1",
    "shard_grad_op": "ZeRO-2",
    "full_shard": "FSDP/ZeRO-3",
    "hybrid_shard": "HSDP",
}


# ----------------------------------------------------------------------------- inputs


def resolve_target(args):
    """(device count, Target or None) from the target flags (`fsdp_jax.app.cli.args.add_target`); PlanError /
    TargetError naming the flag."""

    n = devices_without_target(args)
    if args.target is None:
        return n, None
    target = make_target(
        args.target,
        devices=n,
        hosts=None if args.hosts is None else parse_devices(args.hosts, "--hosts"),
        slices=None if args.slices is None else parse_devices(args.slices, "--slices"),
        topology=args.topology,
    )
    if getattr(args, "tpu_flags", None) is not None:
        target = _with_tpu_flags(target, args.tpu_flags)
    return parse_devices(target.devices), target


def _with_tpu_flags(target, name: str):
    """`target` compiling with libtpu flag set `name`; PlanError naming --tpu-flags."""

    if target.platform != "tpu":
        raise PlanError(f"--tpu-flags: {name!r} needs a TPU --target, not {target.name}")
    try:
        return dataclasses.replace(target, libtpu_args=" ".join(flag_set(name)))
    except ValueError as e:
        raise PlanError(f"--tpu-flags: {e}") from None


def check_inputs(cfg, n_devices: int, strategies: Sequence[str]) -> None:
    """Device count, mesh and batch divisibility for every strategy, before compiling."""

    if not isinstance(n_devices, int) or isinstance(n_devices, bool) or n_devices < 1:
        raise PlanError(f"--devices: {n_devices!r} must be a positive integer")
    validate(cfg, n_devices=n_devices)  # mesh sizes and batch divisibility (hybrid keeps data*fsdp)
    for s in strategies:
        get_strategy(s)


# ----------------------------------------------------------------------------- start-up


def load_planning_config(path, overrides: Sequence[str], n_devices: int, target=None):
    """The planning scripts' start-up: the config at `path` with dotted key=value
    `overrides` (its errors, `fsdp_jax.app.exits.BAD_INPUT`, propagate before JAX is
    touched; precision matmul=fp8 for a `target` without FP8 units is one of them), then
    `use_cpu_devices(n_devices)`. Returns the config."""

    cfg = load_run_config(path, overrides)
    if target is not None:
        check_fp8_device(cfg, target.platform, target.name)
    use_cpu_devices(n_devices)
    return cfg
