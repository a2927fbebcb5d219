"""Peak host memory of `init_from=hf:` (fsdp_jax.app.hf.load.load_params) against the model's size.

    python scripts/measure_hf_import.py --d-model 256 --layers 4 --vocab 2560 [--json]
    fsdp-jax measure-hf-import ...   (the same command)

Writes a random bfloat16 Hugging Face Llama checkpoint (config.json + sharded
safetensors, no torch needed) to a temporary directory, plans full_shard over the
8 CPU devices, then imports it, sampling this process's resident set size
(/proc/self/status VmRSS, every 2 ms, and getrusage's exact high-water mark). On CPU
the imported float32 params themselves live in host memory (the "devices"), so the
figure to read is the peak increase over the params' own bytes: a loader that
staged the whole model on the host first shows about twice the params. For
comparison it repeats the import the naive way (read every tensor whole, convert,
stack, then device_put the tree) in a fresh process.

With `--base-quant nf4|int8` it measures a QLoRA base instead (r16 all-linear, NF4 with
double quantisation, block 64): quantised as it loads, streamed layer by layer
(`fsdp_jax.app.trainer.qlora_load`) against loading the float32 base whole first and then
quantising it; the figure to read is the peak increase over the quantised params' bytes.
`--unscanned` builds the model with `model.scan_layers=false` (one leaf per layer's weight,
streamed weight by weight).
"""

from __future__ import annotations

import argparse

from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    ap.add_argument("--d-model", type=int_in(8, 1 << 16), default=256)
    ap.add_argument("--layers", type=int_in(1, 1024), default=4)
    ap.add_argument("--vocab", type=int_in(2, 1 << 20), default=2560)
    ap.add_argument("--base-quant", choices=("none", "nf4", "int8"), default="none")
    ap.add_argument("--unscanned", action="store_true", help="model.scan_layers=false: one leaf per layer")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), "fsdp_jax.app.cli.run.measure_hf_import:run", argv)
