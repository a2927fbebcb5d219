"""The planning commands' flag values that need no JAX: sizes, device counts, the flags that
need a --target, and `plan`'s own checks up to its first that needs one of the library's tables
(`check_plan_flags`: `fsdp_jax.app.cli.plan`'s `before`). A refusal here costs ~0.1 s of CPU
in a fresh process, not ~3 s. `fsdp_jax.app.planner.inputs` reads the rest (targets, strategies,
the config against the devices)."""

from __future__ import annotations

from fsdp_jax.app.host_memory import parse_size
from fsdp_jax.errors import PlanError

MAX_DEVICES = 1 << 16  # fake CPU devices are real threads and buffers: bound what a typo asks for
SEARCH_ONLY = ("remat", "microbatches", "vary", "attention", "headroom", "max_compiles", "rows", "progress")


def parse_bytes(text: str | int, what: str = "--device-memory") -> int:
    """'80GB' -> 80e9, '80GiB' -> 80 * 2**30, '141G' -> 141e9, '1.5TB', '4096' (bytes):
    `fsdp_jax.app.host_memory.parse_size`, a bad size a PlanError."""
    return parse_size(text, what, PlanError)


def parse_devices(text: str | int, what: str = "--devices") -> int:
    """A device count as a script takes it: a positive integer, else `PlanError`."""
    try:
        n = int(text)
    except ValueError:
        raise PlanError(f"{what}: {text!r} is not an integer") from None
    if not 1 <= n <= MAX_DEVICES:
        raise PlanError(f"{what}: {n} must be in 1..{MAX_DEVICES}")
    return n


def devices_without_target(args) -> int | None:
    """`resolve_target`'s checks before a target is built: a target-only flag without --target,
    then --devices (a count; required without --target). The count, or None (a target's)."""
    for flag in ("hosts", "slices", "topology", "tpu_flags"):
        if getattr(args, flag, None) is not None and args.target is None:
            raise PlanError(f"--{flag.replace('_', '-')}: {getattr(args, flag)!r} needs --target")
    n = None if args.devices is None else parse_devices(args.devices)
    if args.target is None and n is None:
        raise PlanError("--devices: give the number of devices to plan for")
    return n


def check_plan_flags(args) -> None:
    """`plan`'s checks (without --search), in its body's order, up to the first that needs JAX
    (a --target built, strategy or offload names read from the library): the search-only flags,
    the target-only flags and --devices; without a --target also --explain-time and
    --device-memory. The body runs them all again."""
    if args.search:
        return
    for flag in SEARCH_ONLY:
        if getattr(args, flag) not in (None, False):
            raise PlanError(f"--{flag.replace('_', '-')}: only with --search")
    devices_without_target(args)
    if args.target is not None:
        return
    if args.explain_time:
        raise PlanError("--explain-time: only with --target (the op-by-op prediction needs a GPU/TPU compile)")
    if args.device_memory is not None:
        parse_bytes(args.device_memory)
