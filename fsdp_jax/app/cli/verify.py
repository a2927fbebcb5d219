"""Does the trainer's model train the same on one device and under each strategy on N?

    fsdp-jax verify --config configs/tiny.yaml
    fsdp-jax verify --config configs/llama2_7b.yaml --devices 8 --steps 3 --json
    fsdp-jax verify --config configs/small.yaml --strategies zero3,ddp optimizer.name=sgd

(`python scripts/verify.py ...` is the same command.) `fsdp_jax.verify.run` on the config's
model (fsdp_jax/app/models/decoder.py), loss, optimizer, precision, remat, microbatches and clipping, with the
trainer's own batches when `data.path` holds a packed corpus (or a token corpus with
`data.document_mask`: the masked, per-segment step; fsdp_jax.app.verify_batches), else
random tokens of the config's batch shape: `--steps` steps on one device, the same steps under each strategy on `--devices`
devices (fake CPU devices when this machine has fewer). The optimizer runs at its peak
learning rate (warmup skipped) so that the few steps make full-size updates.
On a mixture-of-experts config the step's expert load is compared exactly too: from a step at
which a strategy's differs (a token whose top-k router choice nearly tied flipped) that
strategy's steps are reported, not judged; at step 1 it fails (docs/moe.md).

A config too big for this machine (over --max-params, default 20M) is verified at a
reduced depth and width that keeps every sharding decision: each dim shrinks to a size
with the same divisibility by the device count (so by every mesh axis), the logical names
are the model's own, `mesh.min_shard_size` is rescaled so the same params stay
replicated, and the per-param specs of the full and the reduced model are compared
under every strategy before anything runs (`fsdp_jax.app.verify_shrink`). The output
says which dims shrank and to what. Trailing key=value arguments override the config as in `fsdp-jax train`.

Exit codes: 0 every strategy passed, 1 a strategy failed verification (or an
environment failure), 2 bad input (one line on stderr).
"""

from __future__ import annotations

from fsdp_jax.app.cli.args import add_config, add_devices, config_agrees_before_jax, config_before_jax
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in, real_in
from fsdp_jax.app.planner.flag_values import parse_devices, parse_strategies
from fsdp_jax.errors import PlanError, VerifyError


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, example="optimizer.name=sgd")
    ap.add_argument("--strategies", default="all", help="all, or a comma list (aliases ok: ddp,zero3)")
    add_devices(ap, "8", text="devices to verify on (default 8)")
    ap.add_argument("--steps", type=int_in(1), default=3, help="train steps compared (default 3)")
    ap.add_argument("--seed", type=int_in(0, 2**63 - 1), default=0, help="init and batch seed")
    ap.add_argument(
        "--max-params", type=real_in(0), default=20e6, help="shrink models with more params than this (0: never shrink)"
    )
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    return ap


def _errors():

    return (PlanError, VerifyError), ()


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(
        build_parser(prog), "fsdp_jax.app.cli.run.verify:run", argv, errors=_errors, before=_before, computes=True
    )


def _before(args) -> None:
    """The refusals that need no JAX, in the order the command always gave them: the config
    field by field, then --devices and --strategies (the body's first two checks)."""
    config_before_jax(args)
    parse_devices(args.devices)
    parse_strategies(args.strategies)
    config_agrees_before_jax(args)  # the checks across fields that need no JAX
