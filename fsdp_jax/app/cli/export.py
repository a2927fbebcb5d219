"""Export a run's params as one consolidated safetensors file, or as a Hugging Face model.

    fsdp-jax export RUN_DIR --out model.safetensors [--dtype bfloat16] [--step N]
    fsdp-jax export RUN_DIR --hf OUT_DIR [--dtype bfloat16] [--max-shard-size 5GB]
    fsdp-jax export LORA_RUN_DIR --peft OUT_DIR       # adapter_config.json + adapter_model.safetensors

(`python scripts/export.py ...` is the same command.) --hf writes a directory
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads as the model's family
(Llama, Mistral, Qwen2, Qwen3, Gemma 3; docs/hf_models.md): config.json,
model.safetensors (or shards + model.safetensors.index.json above --max-shard-size) and
the tokenizer files of the model the run was imported from (init_from=hf:DIR) or of its
corpus (fsdp_jax.app.hf.export). For a LoRA run (a `lora:` section), --peft writes its
adapters as a PEFT directory (`PeftModel.from_pretrained(base, OUT_DIR)` loads it) and --hf
the base (init_from=hf:DIR) with the adapters merged, W + scale * B A; tensors LoRA did not
touch are the base's bytes (fsdp_jax.app.hf.export_lora).

RUN_DIR is a train run directory (its checkpoints/ is used) or a checkpoint
directory. Keys are slash-separated param paths ("blocks/attn/wq"); stacked layers
keep their leading layer dim. Leaves are read one at a time into host memory (the
optimizer state is never read), so no accelerator is needed. The newest checkpoint
that passes its manifest check is used unless --step is given. Train from the file
with `init_from=model.safetensors`. Exit codes: 0 success, 2 bad input (one line on
stderr), 1 anything else (e.g. the disk filled up while writing: no partial file is left).
"""

from __future__ import annotations

from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in
from fsdp_jax.checkpoint import CheckpointError

DTYPES = ("float32", "bfloat16", "float16")


_UNITS = {"KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "B": 1}


def parse_size(text: str, flag: str = "--max-shard-size") -> int:
    """A positive byte size like 5GB, 500MB or 2GiB; CheckpointError naming `flag`."""

    t = text.strip().upper()
    for unit, mult in sorted(_UNITS.items(), key=lambda kv: -len(kv[0])):
        if t.endswith(unit):
            try:
                n = float(t[: -len(unit)])
            except ValueError:
                break
            if 0 < n * mult < 2**63:  # (also refuses nan and inf)
                return int(n * mult)
            break
    raise CheckpointError(f"{flag} {text!r}: expected a size like 5GB, 500MB or 2GiB")


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    ap.add_argument("run_dir", help="train run directory or checkpoint directory")
    dest = ap.add_mutually_exclusive_group(required=True)
    dest.add_argument("--out", help="output .safetensors file")
    dest.add_argument("--hf", help="output Hugging Face model directory (must not exist)")
    dest.add_argument("--peft", help="output PEFT adapter directory of a LoRA run (must not exist)")
    ap.add_argument("--max-shard-size", default="5GB", help="--hf: largest weight file, e.g. 5GB, 500MB (default 5GB)")
    ap.add_argument("--dtype", choices=DTYPES, default=None, help="cast floating-point params (default: as saved)")
    ap.add_argument("--step", type=int_in(0), default=None, help="checkpoint step (default: newest)")
    return ap


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), "fsdp_jax.app.cli.run.export:run", argv, computes=True)
