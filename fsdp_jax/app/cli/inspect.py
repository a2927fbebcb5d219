"""How a config shards under one strategy, and what the compiled step communicates.

    fsdp-jax inspect --config configs/tiny.yaml --devices 8 --strategy full_shard
    fsdp-jax inspect --config configs/llama2_7b.yaml --devices 8 --strategy zero3 --json
    fsdp-jax inspect --config configs/llama2_7b.yaml --target h100 --devices 16 --hosts 2

(`python scripts/inspect.py ...` is the same command.) Prints a per-parameter
table (path, shape, dtype, spec, bytes per device, why), the collectives of the
AOT-compiled train step (count and bytes per step, inside and outside the layer loop;
in-loop bytes are multiplied by the loop's trip count), and warnings a user can act on:
large replicated parameters, parameter all-gathers hoisted out of the layer loop,
activations resharded with all-to-all, and a compiled peak more than 10% above the
analytic estimate. With --target (h100, h200, a100, rtx4090, ...; XLA:GPU, deviceless, after
`python -m fsdp_jax.targets install`) it also lists every collective of the scheduled
GPU program: kind, dtype, bytes, loop, forward/backward, async or not, the compute
scheduled between its start and done, and whether its group crosses hosts; and warns
about gradient all-reduces where a reduce-scatter was expected, float32 gathers under
bfloat16 compute, collectives nothing overlaps, and the partitioner's involuntary full
rematerializations (naming the tensor). Trailing key=value arguments override the
config. Exit codes: 0 success, 2 bad input, 1 anything else.
"""

from __future__ import annotations

import json
import sys

from fsdp_jax.app.cli.args import add_config, add_target
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser
from fsdp_jax.app.cli.plan import planning_errors
from fsdp_jax.app.planner.compile_child import run_strategies
from fsdp_jax.app.planner.inputs import (
    check_inputs,
    load_planning_config,
    parse_bytes,
    parse_strategies,
    resolve_target,
)
from fsdp_jax.app.planner.report import format_inspection
from fsdp_jax.errors import PlanError
from fsdp_jax.sharding.strategy import get_strategy
from fsdp_jax.targets.xla_flags import parse_flags


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, example="remat=full")
    add_target(ap)
    ap.add_argument("--strategy", default=None, help="strategy (default: the config's mesh.strategy)")
    ap.add_argument(
        "--replicated-threshold",
        default="auto",
        help="flag replicated params at least this big, e.g. 4MiB (default auto: "
        "the larger of 1 MiB and 0.1%% of all parameter bytes)",
    )
    ap.add_argument(
        "--xla-flags",
        default=None,
        help="XLA options for this compile only, e.g. "
        "--xla-flags=--xla_gpu_enable_pipelined_all_gather=true "
        "(compare schedules with and without: fsdp_jax.targets.xla_flags)",
    )
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    return ap


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


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), run, argv, errors=planning_errors)
