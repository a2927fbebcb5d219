"""`fsdp-jax <command> [flags]`: one installed command over the command modules.

    fsdp-jax train --config configs/tiny.yaml train.steps=20
    fsdp-jax plan --config configs/llama2_7b.yaml --devices 8 --device-memory 80GB
    fsdp-jax <command> --help

Each command is a module of this package with `main(argv, prog)`; `scripts/<name>.py`
is a shim over the same `main` (`SCRIPTS`), so both spellings take the same flags and
give the same exit codes: 0 success, 2 bad input (one line on stderr), 1 anything else.
"""

from __future__ import annotations

import importlib
import sys

from fsdp_jax.app.cli.flags import Parser

# command: (module in fsdp_jax.app.cli, what it does)
COMMANDS: dict[str, tuple[str, str]] = {
    "train": ("train", "train the reference decoder (resumes from the run's checkpoints)"),
    "plan": ("plan", "will it fit? per-device memory under each strategy, on CPU or a GPU/TPU target"),
    "inspect": ("inspect", "how a config shards under one strategy, and what the step communicates"),
    "verify": ("verify", "does the model train the same on one device and under each strategy?"),
    "export": ("export", "a run's params as one safetensors file or a Hugging Face model"),
    "convert": ("convert", "a Hugging Face checkpoint into this project's params"),
    "prepare": ("prepare", "a token corpus or packed fine-tuning examples for training"),
    "plot": ("plot", "plot a run's metrics.jsonl"),
    "launch": ("launch", "run a command as P local jax.distributed processes"),
    "benchmark": ("benchmark", "compile time, step time, tokens/s, MFU and peak memory per strategy"),
    "bench-offload": ("bench_offload", "step time with host offload against none"),
    "gpu-check": ("gpu_check", "the GPU checks the CPU backend cannot show"),
    "measure-hf-import": ("measure_hf_import", "peak host memory of init_from=hf: against the model's size"),
}

# scripts/<name>.py -> the command it is a shim for: one word per command, so the module and
# the script are the command's name (a dash written `_`)
SCRIPTS: dict[str, str] = {module: command for command, (module, _) in COMMANDS.items()}


def command_module(command: str):
    """The module of `command` (a key of COMMANDS)."""
    return importlib.import_module(f"fsdp_jax.app.cli.{COMMANDS[command][0]}")


def script_main(script: str, argv: list[str] | None = None) -> int:
    """What `python scripts/<script>.py` runs: the command's main, named as the script."""
    return command_module(SCRIPTS[script]).main(argv)


def build_parser() -> Parser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {what}" for name, (_, what) in COMMANDS.items())
    ap = Parser(
        prog="fsdp-jax",
        description="Fully Sharded Data Parallel for JAX and Flax: the reference trainer and its tools.",
        usage="%(prog)s [-h] COMMAND [flags ...]",
        epilog=f"commands:\n{listing}\n\n`fsdp-jax COMMAND --help` shows a command's flags.",
    )
    ap.add_argument("command", metavar="COMMAND", choices=list(COMMANDS), help="a command (below)")
    return ap


def main(argv: list[str] | None = None) -> int:
    """The `fsdp-jax` console entry: `COMMAND` picks the module, the rest are its flags."""
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        args = build_parser().parse_args(argv[:1])
    except SystemExit as e:  # --help, no command, or an unknown one: one line, exit 2
        return 2 if e.code else 0
    return command_module(args.command).main(argv[1:], prog=f"fsdp-jax {args.command}")
