#!/usr/bin/env python
"""What bounds a shard-file restore: the disk's reads, or the new memory the arrays need; and whole-file vs piece jobs.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/checkpoint_restore_bounds.py --dir DIR [--reps 4] [--drop-caches]

Saves the 1 GiB float32 state of `checkpoint_write_paths.py` twice: over 8 CPU devices (64
shard files of 16 MiB) and on one device (8 files of 128 MiB, as a one-device run writes).
Then per repetition, in this order on the same disk (with --drop-caches each read follows an
emptied page cache: `checkpoint_write_paths.drop_page_cache`):

- `dd if=/dev/zero bs=16M count=64 oflag=direct` (the yardstick), and `dd iflag=direct` of it;
- new memory: 1 GiB of fresh private anonymous memory (`direct_io.aligned_empty`, the restore's
  destination) faulted in by touching one byte per page -- what any restore into host arrays
  pays before the bytes can land, whatever reads them;
- read ceiling: the 8-device state's 64 files read with O_DIRECT by 8 threads into memory
  already faulted in, no checksum -- what the disk gives the restore's reads;
- `Checkpointer.restore` of each state (manifest check, reads, CRC-32 verification, arrays on
  the devices), with files read as whole-file jobs (each file by one thread, its pieces one after
  another: the restore before this change) and as piece jobs (every 64 MiB piece its own job:
  now), alternating which goes first.

Prints one JSON object per repetition: GB/s (1 GB = 1e9 bytes), each restore's ratio to that
repetition's dd write, and the 1-minute load average. Everything written in DIR is removed.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import tempfile
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import concurrent.futures as cf  # noqa: E402

import numpy as np  # noqa: E402
from jax.sharding import SingleDeviceSharding  # noqa: E402

from benchmarks.checkpoint_write_paths import GIB, abstract, dd, drop_page_cache, make_state, timed  # noqa: E402
from fsdp_jax import checkpoint  # noqa: E402
from fsdp_jax.checkpoint import direct_io, shard_files  # noqa: E402


def new_memory() -> None:
    a = direct_io.aligned_empty((GIB,), np.uint8)
    a[:: direct_io.ALIGN] = 1


def read_ceiling(state_dir: Path):
    """A function reading every file's aligned bulk with O_DIRECT (8 threads) into memory
    faulted in beforehand (here, untimed)."""
    files = [state_dir / e["file"] for m in shard_files.read_index(state_dir).values() for e in m["files"]]
    sizes = [f.stat().st_size // direct_io.ALIGN * direct_io.ALIGN for f in files]
    bufs = [direct_io.aligned_empty((n,), np.uint8) for n in sizes]
    for b in bufs:
        b[:: direct_io.ALIGN] = 1

    def one(k: int) -> None:
        fd = os.open(files[k], os.O_RDONLY | getattr(os, "O_DIRECT", 0))
        view, got = memoryview(bufs[k]), 0
        try:
            while got < len(view):
                got += os.preadv(fd, [view[got:]], got)
        finally:
            os.close(fd)

    def run():
        with cf.ThreadPoolExecutor(shard_files.WORKERS) as pool:
            list(pool.map(one, range(len(files))))

    return run


def restore(root: Path, target, whole_files: bool):
    """A Checkpointer.restore; `whole_files`: each file one job (PIECE past any file's size)."""

    def run():
        real = direct_io.PIECE
        direct_io.PIECE = 1 << 62 if whole_files else real
        try:
            jax.block_until_ready(checkpoint.Checkpointer(root, read_only=True).restore(target).state)
        finally:
            direct_io.PIECE = real

    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before each read (as root)")
    args = ap.parse_args()
    state8 = make_state()
    one = SingleDeviceSharding(jax.devices()[0])
    state1 = jax.block_until_ready({k: jax.device_put(x, one) for k, x in state8.items()})
    d = Path(tempfile.mkdtemp(dir=Path(args.dir).absolute()))
    try:
        targets = {}
        for name, st in (("8_devices", state8), ("1_device", state1)):
            c = checkpoint.Checkpointer(d / name, keep=None, async_save=False)
            c.save(1, st)
            c.close()
            targets[name] = abstract(st)
        del state8, state1, st
        ceiling = read_ceiling(d / "8_devices" / "1" / "state")
        for rep in range(args.reps):
            out = {"rep": rep + 1, "load_avg_1min": round(os.getloadavg()[0], 1)}
            out["dd_oflag_direct"] = timed(lambda: dd(d), GIB)
            out["page_cache"] = drop_page_cache(args.drop_caches)
            out["dd_iflag_direct"] = timed(lambda: dd(d, "read"), GIB)
            out["new_memory"] = timed(new_memory, GIB)
            drop_page_cache(args.drop_caches)
            out["read_ceiling"] = timed(ceiling, GIB)
            for name, target in targets.items():
                order = ((f"restore_{name}_whole_files", True), (f"restore_{name}_pieces", False))
                for key, whole in order if rep % 2 == 0 else order[::-1]:
                    drop_page_cache(args.drop_caches)
                    out[key] = timed(restore(d / name, target, whole), GIB)
                    out[f"{key}_vs_dd"] = round(out[key] / out["dd_oflag_direct"], 3)
            print(json.dumps(out), flush=True)
            gc.collect()
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
