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

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import yaml

from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser
from fsdp_jax.app.config.parse import model_dict
from fsdp_jax.app.hf.load import HFCheckpoint, leaf_sources
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.checkpoint import CheckpointError, tree_paths
from fsdp_jax.checkpoint.safetensors_io import write_safetensors
from fsdp_jax.targets.xla_flags import check_xla_flags

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


def _check_new_files(*paths: tuple[Path | None, str]) -> None:

    for p, flag in paths:
        if p is not None and p.exists():
            raise CheckpointError(f"{flag} {p}: already exists; choose a new path")
        if p is not None and not p.absolute().parent.is_dir():
            raise CheckpointError(f"{flag} {p}: its directory does not exist")


def run(args) -> int:

    out = Path(args.out)
    check_xla_flags()  # before the params are built on the CPU backend
    _check_new_files((out, "--out"), (Path(args.config_out) if args.config_out else None, "--config-out"))
    ckpt = HFCheckpoint(args.hf_dir, base=DecoderConfig(scan_layers=not args.no_scan))
    cfg = ckpt.config
    want = tree_paths(trainer_model(cfg).abstract_params)
    sources = leaf_sources(cfg)
    dt = np.dtype(jnp.dtype(args.dtype))  # bfloat16 via ml_dtypes
    entries = [(p, tuple(sds.shape), dt) for p, sds in sorted(want.items())]

    def fetch(path: str):
        names, kind = sources[path]
        shape = tuple(want[path].shape)
        stacked = cfg.scan_layers and path.startswith("blocks/")
        return ckpt.read(names, kind, tuple(slice(0, n) for n in shape), shape, dt, stacked)

    size = write_safetensors(out, entries, fetch, {"format": "np", "source": f"hf:{args.hf_dir}"})
    section = yaml.safe_dump({"model": model_dict(cfg)}, sort_keys=False)
    if args.config_out:
        Path(args.config_out).write_text(section)
    print(
        f"converted hf:{args.hf_dir} ({ckpt.nbytes() / 2**20:.2f} MiB stored): {len(entries)} "
        f"tensors, {size / 2**20:.2f} MiB -> {out}\n{section}",
        end="",
        flush=True,
    )
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), run, argv)
