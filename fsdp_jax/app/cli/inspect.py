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

from fsdp_jax.app.cli.args import add_config, add_target, config_agrees_before_jax, config_before_jax
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser
from fsdp_jax.app.cli.plan import planning_errors
from fsdp_jax.app.planner.flag_values import devices_without_target


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


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(
        build_parser(prog),
        "fsdp_jax.app.cli.run.inspect:run",
        argv,
        errors=planning_errors,
        before=_before,
        computes=True,
    )


def _before(args) -> None:
    """The refusals that need no JAX, in the order the command always gave them: the config
    field by field, then the target-only flags and --devices (`devices_without_target`; building
    a --target, the next check, needs JAX)."""
    config_before_jax(args)
    devices_without_target(args)
    config_agrees_before_jax(args)  # the checks across fields that need no JAX
