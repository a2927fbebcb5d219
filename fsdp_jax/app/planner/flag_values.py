"""The planning commands' flag values that need no JAX: sizes, device counts, the flags that
need a --target, strategy names (`parse_strategies`), offload settings (`parse_offloads`), and
`plan`'s own checks up to its first that needs JAX (`check_plan_flags`: `fsdp_jax.app.cli.plan`'s
`before`). A refusal here costs ~0.1 s of CPU in a fresh process, not ~3 s.
`fsdp_jax.app.planner.inputs` reads the rest (targets, the config against the devices)."""

from __future__ import annotations

from collections.abc import Sequence

from fsdp_jax.app.host_memory import parse_size
from fsdp_jax.errors import PlanError
from fsdp_jax.sharding.offload_settings import ALL_OFFLOADS
from fsdp_jax.sharding.strategy_names import strategy_name

MAX_DEVICES = 1 << 16  # fake CPU devices are real threads and buffers: bound what a typo asks for
# The classic table's order: DDP, ZeRO-1, ZeRO-2, ZeRO-3, then HSDP.
STRATEGY_ORDER = ("no_shard", "shard_opt", "shard_grad_op", "full_shard", "hybrid_shard")
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


def parse_strategies(text: str | Sequence[str] | None, what: str = "--strategies") -> list[str]:
    """'all' (or None) -> every strategy in STRATEGY_ORDER; 'a,b' -> canonical names (aliases ok)."""
    if text is None or (isinstance(text, str) and text.strip().lower() == "all"):
        return list(STRATEGY_ORDER)
    names = text.split(",") if isinstance(text, str) else list(text)
    out = []
    for n in (x.strip() for x in names):
        if not n:
            continue
        try:
            s = strategy_name(n)  # as `fsdp_jax.sharding.strategy.get_strategy` reads it
        except ValueError as e:
            raise PlanError(f"{what}: {e}") from None
        if s not in out:
            out.append(s)
    if not out:
        raise PlanError(f"{what}: {text!r} names no strategy; use all or e.g. full_shard,no_shard")
    return out


def parse_offloads(text: str | None) -> list[str] | None:
    """`plan --offload`: None (the config's), one setting, a comma list, or `all`."""
    if text is None:
        return None
    names = list(ALL_OFFLOADS) if text.strip() == "all" else [t.strip() for t in text.split(",")]
    bad = [t for t in names if t not in ALL_OFFLOADS]
    if bad or not names:
        raise PlanError(
            f"--offload: {bad[0] if bad else text!r} is not one of {', '.join(ALL_OFFLOADS)} (or all, or a comma list)"
        )
    return list(dict.fromkeys(names))


def check_plan_flags(args) -> None:
    """`plan`'s checks (without --search), in its body's order, up to the first that needs JAX
    (a --target built): the search-only flags, the target-only flags and --devices; without a
    --target also --explain-time, --device-memory, --strategies and --offload. The body runs
    them all again."""
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
    parse_strategies(args.strategies)
    parse_offloads(args.offload)
