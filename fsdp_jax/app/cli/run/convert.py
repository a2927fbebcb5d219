"""`fsdp-jax convert` once its flags have parsed (they and its description: fsdp_jax.app.cli.convert)."""

from __future__ import annotations

from pathlib import Path

import jax.numpy as jnp
import numpy as np
import yaml

from fsdp_jax.app.config.parse import model_dict
from fsdp_jax.app.hf.load import HFCheckpoint, leaf_sources
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.checkpoint import CheckpointError, tree_paths
from fsdp_jax.checkpoint.safetensors_io import write_safetensors
from fsdp_jax.targets.xla_flags import check_xla_flags


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
