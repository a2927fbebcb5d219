"""Will it fit? Per-device memory of a config under each FSDP strategy.

    fsdp-jax plan --config configs/llama2_7b.yaml --devices 8 --device-memory 80GB
    fsdp-jax plan --config configs/llama2_70b.yaml --devices 64 --json
    fsdp-jax plan --config configs/tiny.yaml --devices 8 --plot plan.png remat=full
    fsdp-jax plan --config configs/llama2_70b.yaml --target h100 --devices 64 --hosts 8
    fsdp-jax plan --config configs/llama2_7b.yaml --devices 8 --device-memory 80GB --offload all
    fsdp-jax plan --config configs/llama2_70b.yaml --target h100 --devices 8 --search --vary batch

    fsdp-jax plan --config configs/llama2_7b.yaml --target h100 --devices 8 --explain-time 12

(`python scripts/plan.py ...` is the same command.) For each strategy: analytic bytes
(params, grads, optimizer state, gathered params, activations) and the compiled train
step's memory_analysis() (argument, output, alias, temp, peak), AOT-compiled from
abstract inputs on N devices (N fake CPU devices when this machine has fewer; nothing is
allocated). With --target (h100, h200, a100, rtx4090, rtx3090, l4, l40s, a10g) the step is compiled by XLA:GPU for that
GPU, --devices in total over --hosts hosts, on this machine without a GPU (needs
`python -m fsdp_jax.targets install` once); --device-memory then defaults to the
target's. Trailing key=value arguments override the config as in `fsdp-jax train`.
`--offload` plans with optimizer state / params in host memory (a setting, a comma list
or `all`: then one plan per setting and a strategy x offload table; --json gives
{"offload": {setting: plan}}). With an offload, each strategy's offloaded state per host is
checked against `--host-memory` (else FSDP_JAX_HOST_MEMORY; else, without --target, this
machine's MemAvailable, as a note): over it, that strategy does not fit, and a stated size
that no planned strategy fits is one line, exit 2. `--search` finds the fastest configuration that fits instead
(strategy x remat x microbatches x offload, and batch / seq with --vary;
`fsdp_jax.app.planner.search`): a ranked table, the winner as YAML; nothing fits -> one line
naming the least device memory that would, exit 2. Exit codes: 0 success, 2 bad input (one
line on stderr), 1 anything else.
"""

from __future__ import annotations

import sys

from fsdp_jax.app.cli.args import (
    add_config,
    add_target,
    check_out_file,
    config_agrees_before_jax,
    config_before_jax,
    require,
)
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in, real_in
from fsdp_jax.app.host_memory import stated_host_memory
from fsdp_jax.app.planner.flag_values import check_plan_flags, parse_bytes
from fsdp_jax.errors import PlanError, TargetError


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, example="remat=full")
    add_target(ap)
    ap.add_argument(
        "--list-targets",
        action="store_true",
        help="list every --target (GPUs, rented clusters such as a3-high / a3-mega / p5 / ndr-h100, TPU slices) "
        "with its network figures and their sources, and stop",
    )
    ap.add_argument("--strategies", default="all", help="all, or a comma list (aliases ok: ddp,zero3)")
    ap.add_argument("--device-memory", default=None, help="per-device memory, e.g. 80GB, 80GiB, 141GB")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--plot", default=None, help="write a bar chart PNG here")
    ap.add_argument(
        "--offload",
        default=None,
        help="none | optimizer | optimizer+params | optimizer:nvme ..., a comma list, or all (default: the config's)",
    )
    ap.add_argument(
        "--search",
        action="store_true",
        help="search strategy x remat x microbatches x offload for the fastest config that fits",
    )
    ap.add_argument("--remat", default=None, help="with --search: remat policies to try (comma list, or all)")
    ap.add_argument(
        "--microbatches",
        default=None,
        help="with --search: microbatch counts to try (default: powers of two dividing the batch)",
    )
    ap.add_argument("--vary", default=None, help="with --search: also vary batch and/or seq (e.g. batch,seq)")
    ap.add_argument(
        "--attention",
        default=None,
        help="with --search: attention kernels to try, a comma list of xla, cudnn, splash (default: the "
        "config's, and with a --target xla plus its flash kernel: cudnn on a GPU, splash on a TPU)",
    )
    ap.add_argument("--headroom", default=None, help="with --search: device memory kept free (10%% default, or 8GB)")
    ap.add_argument(
        "--host-memory",
        default=None,
        help="pinned host memory per host (e.g. 1TB): offloaded state over it does not fit (default: "
        "FSDP_JAX_HOST_MEMORY, else this machine's MemAvailable when planning without --target)",
    )
    ap.add_argument(
        "--disk-gbps",
        default=None,
        type=real_in(0, above=True),
        help="with an nvme offload: a host's local-disk bandwidth in GB/s, reads and writes together "
        "(default: the --target's, a node's local NVMe as sourced in the step-time table)",
    )
    ap.add_argument(
        "--max-compiles",
        default=None,
        help="with --search: compile at most this many candidates (default 4; 0: analytic only)",
    )
    ap.add_argument(
        "--progress", action="store_true", help="with --search: progress lines on stderr even when it is not a terminal"
    )
    ap.add_argument("--rows", default=None, help="with --search: rows of the ranked table (default 10)")
    ap.add_argument(
        "--explain-time",
        nargs="?",
        const=10,
        default=0,
        type=int_in(1, 25),
        help="with --target: list the N (<= 25) ops that cost most per step (default 10) under the predicted step time",
    )
    return ap


def planning_errors():
    """The planning commands' own bad-input classes (plan, inspect)."""

    return (PlanError, TargetError), ()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    if "--list-targets" in (sys.argv[1:] if argv is None else argv):  # needs no --config
        from fsdp_jax.targets.clusters import format_targets

        print(format_targets())
        return 0
    argv = sys.argv[1:] if argv is None else [str(a) for a in argv]
    parser = build_parser(prog)
    parser.set_defaults(argv=argv)  # plan --search re-runs itself in a child when this process lacks the devices
    return run_command(
        parser, "fsdp_jax.app.cli.run.plan:run", argv, errors=planning_errors, before=_before, computes=True
    )


def _before(args) -> None:
    """The refusals that need no JAX, in the order the command always gave them: the config
    field by field, then the flags up to the first that needs JAX (`check_plan_flags`; without a
    --target also --plot and the host memory, as the body checks them next), then the checks
    across the config's fields."""
    config_before_jax(args)
    check_plan_flags(args)
    if not args.search and args.target is None:
        if args.plot:
            check_out_file(args.plot, "--plot")
            require("matplotlib", "--plot")
        if args.host_memory is not None:
            parse_bytes(args.host_memory, "--host-memory")
        else:
            stated_host_memory()  # FSDP_JAX_HOST_MEMORY, if set, is a size
    config_agrees_before_jax(args)  # the checks across fields that need no JAX
