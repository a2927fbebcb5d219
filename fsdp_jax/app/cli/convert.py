"""Convert a Hugging Face checkpoint (Llama, Mistral, Qwen2/3, Gemma 3) into this project's params.

    fsdp-jax convert checkpoints/Llama-2-7b-hf --out llama2_7b.safetensors \\
        [--dtype bfloat16] [--config-out llama2_7b_model.yaml]

(`python scripts/convert.py ...` is the same command.) Reads config.json and
model.safetensors (or the shards of model.safetensors.index.json), checks every tensor
against the config (refusing what the decoder cannot compute: one line naming the field;
docs/hf_models.md), and writes one file keyed like the trainer's params
("blocks/attn/wq", layers stacked on a leading dim), one leaf in host memory at a time.
Train from it with `init_from=llama2_7b.safetensors` and the model section printed here
(or written by --config-out). Training straight from the checkpoint needs no conversion:
`init_from=hf:checkpoints/Llama-2-7b-hf`. Exit codes: 0 success, 2 bad input (one line
on stderr, nothing written), 1 anything else.
"""

from __future__ import annotations

from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser

DTYPES = ("float32", "bfloat16", "float16")


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    ap.add_argument("hf_dir", help="Hugging Face model directory (config.json + safetensors)")
    ap.add_argument("--out", required=True, help="output .safetensors file (must not exist)")
    ap.add_argument(
        "--dtype",
        choices=DTYPES,
        default="float32",
        help="dtype of the written params (default float32, the trainer's params)",
    )
    ap.add_argument("--config-out", help="also write the model section as YAML here")
    ap.add_argument("--no-scan", action="store_true", help="per-layer params (model.scan_layers=false)")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), "fsdp_jax.app.cli.run.convert:run", argv, computes=True)
