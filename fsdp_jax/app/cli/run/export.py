"""`fsdp-jax export` once its flags have parsed (they and its description: fsdp_jax.app.cli.export)."""

from __future__ import annotations

import os
from pathlib import Path

from fsdp_jax.app.cli.export import parse_size
from fsdp_jax.app.hf.export import export_hf, saved_source
from fsdp_jax.app.hf.export_lora import export_merged, export_peft
from fsdp_jax.checkpoint import CheckpointError, export_safetensors
from fsdp_jax.targets.xla_flags import check_xla_flags


def _check_out_file(out: Path, flag_value: str) -> None:

    if out.is_dir():
        raise CheckpointError(f"--out {flag_value}: is a directory; give a file path, e.g. {out / 'model.safetensors'}")
    if not out.absolute().parent.is_dir():
        raise CheckpointError(f"--out {flag_value}: its directory does not exist")
    if not os.access(out.absolute().parent, os.W_OK | os.X_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise CheckpointError(f"--out {flag_value}: not writable here; choose a writable place")


def run(args) -> int:

    run_dir = Path(args.run_dir)
    directory = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    check_xla_flags()  # before the checkpoint is read onto the CPU backend
    max_shard_bytes = parse_size(args.max_shard_size)  # checked whatever the destination
    if not directory.is_dir():
        raise CheckpointError(f"{run_dir}: no such run or checkpoint directory")
    if args.peft:
        info = export_peft(directory, args.peft, step=args.step)
        print(f"exported step {info['step']}: {info['tensors']} adapter tensors -> {info['path']}", flush=True)
        return 0
    if args.hf:
        lora = saved_source(directory, args.step)[2].lora.rank > 0
        export = export_merged if lora else export_hf
        info = export(directory, args.hf, dtype=args.dtype, step=args.step, max_shard_bytes=max_shard_bytes)
        print(
            f"exported step {info['step']}: {info['tensors']} tensors in {info['files']} "
            f"file(s), {info['bytes'] / 2**20:.2f} MiB -> {info['path']}",
            flush=True,
        )
        if info.get("dequantised"):
            print(f"note: the base was trained quantised ({info['dequantised']}); merged into its dequantised weights")
        return 0
    out = Path(args.out)
    _check_out_file(out, args.out)
    info = export_safetensors(directory, out, dtype=args.dtype, step=args.step)
    print(
        f"exported step {info['step']}: {info['tensors']} tensors, {info['bytes'] / 2**20:.2f} MiB -> {info['path']}",
        flush=True,
    )
    return 0
