#!/usr/bin/env python
"""What the checkpoint manifest's CRC-32 checksums cost on a ~1 GB checkpoint.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/checkpoint_checksum.py [--gib 1.0] [--dir DIR]

Saves a float32 state of about --gib GiB, sharded over 8 CPU devices, with
`fsdp_jax.checkpoint.Checkpointer` (synchronously, so the time is the whole write),
then reports: the save time, the checksum time over the saved files (what the
background save adds; the same read runs before a restore to verify), and a
restore. Prints one JSON line. The files are deleted afterwards.
"""

from __future__ import annotations

import argparse
import json
import shutil
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from fsdp_jax import checkpoint  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--dir", default=None, help="where to write (default: a temporary directory)")
    args = ap.parse_args()
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = NamedSharding(mesh, P("fsdp"))
    n_leaves = 8
    rows = int(args.gib * 2**30 / 4 / n_leaves / 1024) // 8 * 8
    state = {
        f"w{i}": jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32), out_shardings=sharding)(
            jax.random.key(i)
        )
        for i in range(n_leaves)
    }
    nbytes = sum(x.nbytes for x in state.values())
    root = Path(tempfile.mkdtemp(dir=args.dir))
    try:
        c = checkpoint.Checkpointer(root / "ckpts", keep=None, async_save=False)
        t = time.perf_counter()
        c.save(1, state)
        c.close()
        save_s = time.perf_counter() - t
        step = root / "ckpts" / "1"
        files = [f for item in ("state", "extras") for f in (step / item).rglob("*") if f.is_file()]
        t = time.perf_counter()
        for f in files:
            checkpoint.file_crc32(f)
        crc_s = time.perf_counter() - t
        target = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)
        t = time.perf_counter()
        r = checkpoint.Checkpointer(root / "ckpts", read_only=True).restore(target)
        jax.block_until_ready(r.state)
        restore_s = time.perf_counter() - t
        on_disk = sum(f.stat().st_size for f in files)
        print(
            json.dumps(
                {
                    "state_bytes": nbytes,
                    "files_bytes": on_disk,
                    "files": len(files),
                    "save_s": round(save_s, 3),
                    "crc32_s": round(crc_s, 3),
                    "crc32_GB_per_s": round(on_disk / crc_s / 1e9, 2),
                    "restore_with_verify_s": round(restore_s, 3),
                }
            )
        )
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
