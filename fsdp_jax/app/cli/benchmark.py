"""Measure compile time, step time, tokens/s, MFU and peak memory per strategy.

    fsdp-jax benchmark --config configs/tiny.yaml [--strategies full_shard,no_shard]
        [--steps 10] [--warmup 2] [--sweep model.n_layers=4,8,16,32] [--sweep devices=1,2,4,8]
        [--baselines] [--peak-tflops T] [--json] [--plot sweep.png] [key=value ...]

(`python scripts/benchmark.py ...` is the same command; the runners are
`fsdp_jax.app.planner.benchmark`.) Inputs are random tokens (no data set needed). `--baselines` adds two reference
rows at the same global batch: the same model on one device (`single_device`) and
a plain hand-written JAX data-parallel loop (`plain_dp`: replicated params, batch
sharded, `jax.jit` + `jax.value_and_grad` + optax, no fsdp_jax code in the step).
The sweep key `devices` runs on the first N devices. The persistent compilation
cache is off, so compile times are real. On CPU the process gets
FSDP_JAX_CPU_DEVICES (default 8) host devices. Exit codes: 0, 2 bad input, 1 other.
"""

from __future__ import annotations

from fsdp_jax.app.cli.args import add_config, config_before_jax
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in, real_in


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, example="model.n_layers=4")
    ap.add_argument("--strategies", default="full_shard,shard_grad_op,shard_opt,no_shard,hybrid_shard")
    ap.add_argument("--steps", type=int_in(1), default=10)
    ap.add_argument("--warmup", type=int_in(0), default=2)
    ap.add_argument("--sweep", action="append", default=[], help="KEY=V1,V2 (repeatable)")
    ap.add_argument("--baselines", action="store_true", help="add single_device and plain_dp rows")
    ap.add_argument("--peak-tflops", type=real_in(0, above=True), default=None, help="peak TFLOP/s per device for MFU")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--plot", help="PNG of step time / compile time / memory against the first sweep key")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(
        build_parser(prog), "fsdp_jax.app.cli.run.benchmark:run", argv, before=config_before_jax, computes=True
    )
