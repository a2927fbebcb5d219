#!/usr/bin/env python
"""How a config shards under one strategy, and what the compiled step communicates.

    python scripts/inspect_sharding.py --config configs/tiny.yaml --devices 8 --strategy full_shard
    python scripts/inspect_sharding.py --config configs/llama2_7b.yaml --devices 8 --strategy zero3 --json
    python scripts/inspect_sharding.py --config configs/llama2_7b.yaml --target h100 --devices 16 --hosts 2

Prints a per-parameter table (path, shape, dtype, spec, bytes per device, why), the
collectives of the AOT-compiled train step (count and bytes per step, inside and
outside the layer loop; in-loop bytes are multiplied by the loop's trip count), and
warnings a user can act on: large replicated parameters, parameter all-gathers
hoisted out of the layer loop, activations resharded with all-to-all, and a compiled
peak more than 10% above the analytic estimate. With --target (h100, h200, a100; XLA:GPU,
deviceless, after `python -m fsdp_jax.targets install`) it also lists every collective of
the scheduled GPU program: kind, dtype, bytes, loop, forward/backward, async or not, the
compute scheduled between its start and done, and whether its group crosses hosts; and
warns about gradient all-reduces where a reduce-scatter was expected, float32 gathers
under bfloat16 compute, collectives nothing overlaps, and the partitioner's involuntary
full rematerializations (naming the tensor). Trailing key=value arguments
override the config. Exit codes: 0 success, 2 bad input, 1 anything else.
"""

from __future__ import annotations

import argparse
import json
import sys


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line on stderr, exit code 2."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description=__doc__.splitlines()[1].strip(),
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    from fsdp_jax.app.plan_report import add_target_arguments
    add_target_arguments(ap)
    ap.add_argument("--strategy", default=None, help="strategy (default: the config's mesh.strategy)")
    ap.add_argument("--replicated-threshold", default="auto",
                    help="flag replicated params at least this big, e.g. 4MiB (default auto: "
                         "the larger of 1 MiB and 0.1%% of all parameter bytes)")
    ap.add_argument("--xla-flags", default=None,
                    help="XLA options for this compile only, e.g. --xla-flags=--xla_gpu_enable_pipelined_all_gather=true "
                         "(compare schedules with and without: fsdp_jax.xla_flags)")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0

    from fsdp_jax.app.cli import BAD_INPUT, fail
    from fsdp_jax.app.plan_report import (PlanError, load_planning_config, parse_bytes,
                                      parse_strategies, resolve_target)
    from fsdp_jax.targets import TargetError

    try:
        n, target = resolve_target(args)
        from fsdp_jax.xla_flags import parse_flags
        options = parse_flags(args.xla_flags) if args.xla_flags else None
        threshold = (None if args.replicated_threshold == "auto"
                     else parse_bytes(args.replicated_threshold, "--replicated-threshold"))
        if args.strategy is not None:
            names = parse_strategies(args.strategy, "--strategy")
            if len(names) != 1 or args.strategy.strip().lower() == "all":
                raise PlanError(f"--strategy: {args.strategy!r} must name one strategy "
                                "(scripts/plan.py compares several)")
            args.strategy = names[0]
    except (PlanError, TargetError, ValueError) as e:
        return fail(e)
    from fsdp_jax.strategy import get_strategy
    try:
        cfg = load_planning_config(args.config, args.overrides, n)  # JAX: n CPU devices, from here on
        strategy = get_strategy(args.strategy or cfg.mesh.strategy).name
    except BAD_INPUT as e:
        return fail(e)

    from fsdp_jax.app.plan_report import check_inputs, format_inspection
    from fsdp_jax.app.planner import run_strategies

    try:
        check_inputs(cfg, n, [strategy])
        result = run_strategies(cfg, n, [strategy], inspect=True, replicated_threshold=threshold,
                                target=target, compiler_options=options)[strategy]
    except BAD_INPUT + (PlanError, TargetError) as e:
        return fail(e)
    if args.json:
        json.dump({"config": args.config, "devices": n, "strategy": strategy,
                   "target": args.target, "hosts": None if target is None else target.hosts, **result},
                  sys.stdout, indent=1)
        print()
    else:
        print(format_inspection(strategy, result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
