"""GPU checks that the CPU backend cannot show; run by scripts/gpu_check.sh.

    python scripts/gpu_check.py [--config configs/llama_1b.yaml] [--steps 10] [--json out.json]
    fsdp-jax gpu-check ...   (the same command)

1. throughput: the trainer's step for the config (bf16 compute, cuDNN attention,
   `dots` remat) on all local GPUs with full_shard: tokens/s, MFU, peak memory;
2. precision: a small model's loss and grad norm with bf16 compute match fp32
   within bf16 tolerance;
3. collectives (needs >= 2 devices): under full_shard with bf16 compute the
   parameter all-gathers move bf16 and gradients are reduce-scattered;
4. the GPU-only paths against the XLA path on the same batch (`fsdp_jax.app.cli.gpu_paths`):
   cudnn_packed, ring_cudnn, tokamax_moe, lora, offload (issue 63).
`--smoke`: a CPU rehearsal (XLA twins of the GPU kernels, tiny shapes). Installs nothing. Prints one line per check and a final table. Exit codes: 0 every check
passed, 1 a check failed, 2 bad input (one line on stderr).
"""

from __future__ import annotations

from fsdp_jax.app.cli.args import add_config, check_out_file
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in
from fsdp_jax.app.config.early_checks import check_before_jax
from fsdp_jax.app.config.read import read_config
from fsdp_jax.errors import UsageError


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, required=False, default="configs/llama_1b.yaml", example="train.global_batch=16")
    ap.add_argument("--steps", type=int_in(1), default=10, help="timed steps (default 10)")
    ap.add_argument("--json", help="write all results here")
    ap.add_argument("--only", default="throughput,precision,collectives", help=f"a comma list of: {', '.join(CHECKS)}")
    ap.add_argument("--smoke", action="store_true", help="CPU rehearsal: XLA in place of GPU kernels, tiny shapes")
    return ap


CHECKS = ("throughput", "precision", "collectives", "cudnn_packed", "ring_cudnn", "tokamax_moe", "lora", "offload")


def check_flags(args) -> None:
    """`run_command`'s `before`: the checks of the body's start that need no JAX, in its order:
    --only and --steps, the config field by field when throughput runs (`read_config`; the body
    reads it whole), --json writable, then the config's checks across fields that need no JAX
    (`early_checks.check_before_jax`). A refusal here costs ~0.1 s of CPU, not ~3 s."""
    bad = [n for n in args.only.split(",") if n not in CHECKS]
    if bad or args.steps < 1:
        raise UsageError(f"--only {args.only!r} / --steps {args.steps}: checks are {', '.join(CHECKS)}; steps >= 1")
    cfg = read_config(args.config, args.overrides) if "throughput" in args.only.split(",") else None
    if args.json:
        check_out_file(args.json, "--json")
    if cfg is not None:
        check_before_jax(cfg)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), "fsdp_jax.app.cli.run.gpu_check:run", argv, before=check_flags)
