#!/usr/bin/env python
"""Where a checkpoint save's time goes: the disk's direct-write bandwidth and each write path, side by side.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/checkpoint_write_paths.py --dir DIR [--reps 2]

One float32 state of 1 GiB (8 leaves, each sharded over 8 CPU devices) is written, per
repetition and interleaved so that a busy machine slows every path alike, by:
`dd if=/dev/zero bs=16M count=64 oflag=direct` (the disk), `fsdp_jax.checkpoint.Checkpointer`
(synchronous: Orbax + the CRC-32 manifest), Orbax's PyTreeCheckpointHandler with OCDBT (its
default), without OCDBT, and with OCDBT + zarr3, and a raw write of every shard's bytes to its
own file with fsync (no format at all: the floor of what serialisation can add). Prints one
JSON line of GB/s per path (1 GB = 1e9 bytes), one value per repetition. DIR must be on the disk
to measure; everything written there is removed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import tempfile
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

GIB = 2**30


def make_state():
    mesh = jax.make_mesh((8,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))
    sh = NamedSharding(mesh, P("fsdp"))
    rows = GIB // 4 // 8 // 1024 // 8 * 8
    make = jax.jit(lambda k: jax.random.normal(k, (rows, 1024), jnp.float32), out_shardings=sh)
    return {f"w{i}": make(jax.random.key(i)) for i in range(8)}


def timed(fn, nbytes: int) -> float:
    t = time.perf_counter()
    fn()
    return round(nbytes / (time.perf_counter() - t) / 1e9, 3)


def paths(state, where: Path) -> dict:
    import orbax.checkpoint as ocp

    from fsdp_jax import checkpoint as ck

    def dd(d):
        subprocess.run(
            ["dd", "if=/dev/zero", f"of={d / 'dd.bin'}", "bs=16M", "count=64", "oflag=direct"],
            check=True,
            capture_output=True,
        )

    def checkpointer(d):
        c = ck.Checkpointer(d / "c", keep=None, async_save=False)
        c.save(1, state)
        c.close()

    def orbax(**opts):
        return lambda d: ocp.Checkpointer(ocp.PyTreeCheckpointHandler(**opts)).save(
            d / "x", args=ocp.args.PyTreeSave(state)
        )

    def raw(d):
        for k, x in state.items():
            for i, shard in enumerate(x.addressable_shards):
                with open(d / f"{k}.{i}", "wb") as fh:
                    np.asarray(shard.data).tofile(fh)
                    fh.flush()
                    os.fsync(fh.fileno())

    return {
        "dd_oflag_direct": (dd, GIB),
        "checkpointer": (checkpointer, None),
        "orbax_ocdbt": (orbax(use_ocdbt=True), None),
        "orbax_no_ocdbt": (orbax(use_ocdbt=False), None),
        "orbax_ocdbt_zarr3": (orbax(use_ocdbt=True, use_zarr3=True), None),
        "raw_fsync": (raw, None),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    state = make_state()
    nbytes = sum(x.nbytes for x in state.values())
    out: dict[str, list[float]] = {}
    for _ in range(args.reps):
        for name, (fn, size) in paths(state, Path(args.dir).absolute()).items():
            d = Path(tempfile.mkdtemp(dir=args.dir)).absolute()
            try:
                out.setdefault(name, []).append(timed(lambda: fn(d), size or nbytes))
            finally:
                shutil.rmtree(d, ignore_errors=True)
    print(json.dumps({"jax": jax.__version__, "GB_per_s": out}))


if __name__ == "__main__":
    main()
