"""`fsdp-jax inspect` once its flags have parsed (they and its description: fsdp_jax.app.cli.inspect)."""

from __future__ import annotations

import json
import sys

from fsdp_jax.app.planner.compile_child import run_strategies
from fsdp_jax.app.planner.flag_values import parse_bytes, parse_strategies
from fsdp_jax.app.planner.inputs import check_inputs, load_planning_config, resolve_target
from fsdp_jax.app.planner.report import format_inspection
from fsdp_jax.errors import PlanError
from fsdp_jax.sharding.strategy import get_strategy
from fsdp_jax.targets.xla_flags import parse_flags


def run(args) -> int:

    n, target = resolve_target(args)
    try:
        options = parse_flags(args.xla_flags) if args.xla_flags else None
    except ValueError as e:  # names the flag
        raise PlanError(str(e)) from None
    threshold = (
        None
        if args.replicated_threshold == "auto"
        else parse_bytes(args.replicated_threshold, "--replicated-threshold")
    )
    if args.strategy is not None:
        names = parse_strategies(args.strategy, "--strategy")
        if len(names) != 1 or args.strategy.strip().lower() == "all":
            raise PlanError(f"--strategy: {args.strategy!r} must name one strategy (the plan command compares several)")
        args.strategy = names[0]
    cfg = load_planning_config(args.config, args.overrides, n, target)  # JAX: n CPU devices, from here on
    strategy = get_strategy(args.strategy or cfg.mesh.strategy).name

    check_inputs(cfg, n, [strategy])
    result = run_strategies(
        cfg, n, [strategy], inspect=True, replicated_threshold=threshold, target=target, compiler_options=options
    )[strategy]
    if args.json:
        json.dump(
            {
                "config": args.config,
                "devices": n,
                "strategy": strategy,
                "target": args.target,
                "hosts": None if target is None else target.hosts,
                **result,
            },
            sys.stdout,
            indent=1,
        )
        print()
    else:
        print(format_inspection(strategy, result))
    return 0
