"""Step time with host offload against none, interleaved so machine load hits every setting alike.

    python scripts/bench_offload.py --config configs/tiny.yaml [--strategy full_shard]
        [--rounds 5] [--steps 3] [--json] [key=value ...]
    fsdp-jax bench-offload ...   (the same command)

Builds the trainer's step (`fsdp_jax.app.planner.abstract_step.build_step`) once per offload setting
(none, optimizer, optimizer+params), compiles all three, then runs `rounds` rounds; each
round times `steps` steps of every setting in turn (blocking on each step). Reports the
median step time per setting, its ratio to `none`, and the host<->device bytes per step
and device (`fsdp_jax.sharding.offload.transfer_bytes`). On CPU the memory kinds share one RAM, so
the ratio shows the program's overhead, not PCIe time. Exit codes: 0, 2 bad input, 1 other.
"""

from __future__ import annotations

from fsdp_jax.app.cli.args import add_config, config_agrees_before_jax, config_before_jax
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in
from fsdp_jax.errors import OffloadError, UsageError
from fsdp_jax.sharding.strategy_names import strategy_name


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, example="remat=full")
    ap.add_argument("--strategy", default="full_shard", help="strategy (default full_shard)")
    ap.add_argument("--rounds", type=int_in(1), default=5, help="rounds of every setting (default 5)")
    ap.add_argument("--steps", type=int_in(1), default=3, help="steps per setting per round (default 3)")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    return ap


def _errors():

    return (OffloadError,), ()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(
        build_parser(prog),
        "fsdp_jax.app.cli.run.bench_offload:run",
        argv,
        errors=_errors,
        before=_before,
        computes=True,
    )


def _before(args) -> None:
    """The refusals that need no JAX, in the order the command always gave them: the config
    field by field, then --strategy (the body's first check), then the checks across the
    config's fields that need no JAX (the start of the body's `validate`)."""
    config_before_jax(args)
    try:
        strategy_name(args.strategy)
    except ValueError as e:  # an unknown name, listing the choices
        raise UsageError(f"--strategy: {e}") from None
    config_agrees_before_jax(args)
