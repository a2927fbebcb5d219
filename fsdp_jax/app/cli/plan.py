"""Will it fit? Per-device memory of a config under each FSDP strategy.

    fsdp-jax plan --config configs/llama2_7b.yaml --devices 8 --device-memory 80GB
    fsdp-jax plan --config configs/llama2_70b.yaml --devices 64 --json
    fsdp-jax plan --config configs/tiny.yaml --devices 8 --plot plan.png remat=full
    fsdp-jax plan --config configs/llama2_70b.yaml --target h100 --devices 64 --hosts 8
    fsdp-jax plan --config configs/llama2_7b.yaml --devices 8 --device-memory 80GB --offload all

(`python scripts/plan.py ...` is the same command.) For each strategy: analytic bytes
(params, grads, optimizer state, gathered params, activations) and the compiled train
step's memory_analysis() (argument, output, alias, temp, peak), AOT-compiled from
abstract inputs on N devices (N fake CPU devices when this machine has fewer; nothing is
allocated). With --target (h100, h200, a100) the step is compiled by XLA:GPU for that
GPU, --devices in total over --hosts hosts, on this machine without a GPU (needs
`python -m fsdp_jax.targets install` once); --device-memory then defaults to the
target's. Trailing key=value arguments override the config as in `fsdp-jax train`.
`--offload` plans with optimizer state / params in host memory (a setting, a comma list
or `all`: then one plan per setting and a strategy x offload table; --json gives
{"offload": {setting: plan}}). Exit codes: 0 success, 2 bad input (one line on stderr),
1 anything else.
"""

from __future__ import annotations

import json
import sys

from fsdp_jax.app.cli.args import add_config, add_target
from fsdp_jax.app.cli.flags import Parser


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, example="remat=full")
    add_target(ap)
    ap.add_argument("--strategies", default="all", help="all, or a comma list (aliases ok: ddp,zero3)")
    ap.add_argument("--device-memory", default=None, help="per-device memory, e.g. 80GB, 80GiB, 141GB")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--plot", default=None, help="write a bar chart PNG here")
    ap.add_argument("--offload", default=None,
                    help="none | optimizer | optimizer+params, a comma list, or all (default: the config's)")
    return ap


def planning_errors():
    """The planning commands' own bad-input classes (plan, inspect)."""
    from fsdp_jax.app.plan_report import PlanError
    from fsdp_jax.targets import TargetError
    return (PlanError, TargetError), ()


def parse_offloads(text: str | None) -> list[str] | None:
    """`--offload`: None (the config's), one setting, a comma list, or `all`."""
    from fsdp_jax.app.plan_report import PlanError
    from fsdp_jax.offload import OFFLOADS
    if text is None:
        return None
    names = list(OFFLOADS) if text.strip() == "all" else [t.strip() for t in text.split(",")]
    bad = [t for t in names if t not in OFFLOADS]
    if bad or not names:
        raise PlanError(f"--offload: {bad[0] if bad else text!r} is not one of "
                        f"{', '.join(OFFLOADS)} (or all, or a comma list)")
    return list(dict.fromkeys(names))


def run(args) -> int:
    import dataclasses

    from fsdp_jax.app.cli.args import check_out_file, require
    from fsdp_jax.app.plan_report import (
        format_table,
        load_planning_config,
        parse_bytes,
        parse_strategies,
        plot_plan,
        resolve_target,
    )

    n, target = resolve_target(args)
    mem = parse_bytes(args.device_memory) if args.device_memory is not None else None
    strategies = parse_strategies(args.strategies)
    offloads = parse_offloads(args.offload)
    if args.plot:
        check_out_file(args.plot, "--plot")
        require("matplotlib", "--plot")
    cfg = load_planning_config(args.config, args.overrides, n)  # JAX: n CPU devices, from here on

    from fsdp_jax.app.planner import format_offload_table, plan_config
    docs = {}
    for o in offloads or [cfg.offload]:
        docs[o] = plan_config(dataclasses.replace(cfg, offload=o), n, strategies,
                              device_memory=mem, config_name=args.config, target=target)
    if len(docs) > 1:
        if args.json:
            json.dump({"offload": docs}, sys.stdout, indent=1)
            print()
        else:
            for o, doc in docs.items():
                print(f"=== offload {o}\n{format_table(doc)}\n")
            print(format_offload_table(docs))
        return 0
    doc = next(iter(docs.values()))
    if args.plot:
        plot_plan(doc, args.plot)
    if args.json:
        json.dump(doc, sys.stdout, indent=1)
        print()
    else:
        print(format_table(doc))
        if args.plot:
            print(f"plot: {args.plot}")
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:
    from fsdp_jax.app.cli.command import run_command
    return run_command(build_parser(prog), run, argv, errors=planning_errors)
