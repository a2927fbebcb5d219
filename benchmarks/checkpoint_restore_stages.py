#!/usr/bin/env python
"""Where a shard-file checkpoint restore's time goes, and the restore before / after issue 43's fix.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/checkpoint_restore_stages.py --dir DIR [--reps 3]

Saves the 1 GiB float32 state of `checkpoint_write_paths.py` (8 leaves over 8 CPU devices: 64
shard files of 16 MiB) once, then per repetition, in this order on the same disk:
`dd oflag=direct` and `dd iflag=direct` (the disk's direct bandwidths); every file read
serially, timing each stage summed over the files -- the destination's allocation, the O_DIRECT
read (which faults the destination's pages in), zlib's CRC-32 and zlib-ng's over the same
bytes -- into a shared anonymous mmap (as restores did before), a private one (what
`direct_io.aligned_empty` gives now) and a private one faulted in by the mmap call
(MAP_POPULATE, for comparison); then whole `Checkpointer.restore`s (manifest check, reads,
CRC-32 verification, arrays on the 8 devices): the earlier path (zlib's CRC-32, shared
mappings) and the current one, each first in every other repetition and from a collected heap,
with their wall, user and system seconds. Prints one JSON object per repetition. Everything written in DIR
is removed.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import os
import resource
import shutil
import subprocess
import tempfile
import time
import zlib
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from zlib_ng import zlib_ng  # noqa: E402

from benchmarks.checkpoint_write_paths import GIB, abstract, make_state  # noqa: E402
from fsdp_jax import checkpoint  # noqa: E402
from fsdp_jax.checkpoint import direct_io, shard_files  # noqa: E402


def dd(d: Path, args: list[str]) -> float:
    t = time.perf_counter()
    subprocess.run(["dd", *args, "bs=16M", "count=64"], check=True, capture_output=True)
    return round(GIB / (time.perf_counter() - t) / 1e9, 3)


MAPPINGS = {
    "shared": {},
    "private": {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS},
    "private_populated": {"flags": mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | mmap.MAP_POPULATE},
}


def shared_empty(shape, dtype) -> np.ndarray:
    """`direct_io.aligned_empty` as it was: a shared anonymous mapping."""
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return np.frombuffer(mmap.mmap(-1, max(n, 1)), np.uint8, n).view(dtype).reshape(shape)


def stages(state_dir: Path, mapping: str) -> dict[str, float]:
    """Seconds per stage, summed over the files, each file read serially."""
    out = dict(alloc=0.0, read=0.0, crc_zlib=0.0, crc_zlib_ng=0.0)
    keep = []
    for m in shard_files.read_index(state_dir).values():
        for e in m["files"]:
            t0 = time.perf_counter()
            mm = mmap.mmap(-1, e["bytes"], **MAPPINGS[mapping])
            raw = np.frombuffer(mm, np.uint8)
            t1 = time.perf_counter()
            fd, bulk, got = os.open(state_dir / e["file"], os.O_RDONLY | os.O_DIRECT), len(raw) // 4096 * 4096, 0
            try:  # the aligned bulk, as direct_io.read_file reads it (less the CRC, timed below)
                while got < bulk:
                    got += os.preadv(fd, [memoryview(raw)[got:bulk]], got)
            finally:
                os.close(fd)
            t2 = time.perf_counter()
            zlib.crc32(raw)
            t3 = time.perf_counter()
            zlib_ng.crc32(raw)
            t4 = time.perf_counter()
            for k, dt in zip(out, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                out[k] += dt
            keep.append(raw)  # as a restore keeps its arrays: no page is reused
    return {k: round(v, 3) for k, v in out.items()}


def restore(root: Path, target, earlier: bool) -> dict[str, float]:
    """One Checkpointer.restore; `earlier`: zlib's CRC-32 and shared mappings, as before."""
    real_crc, real_empty = direct_io.crc32, direct_io.aligned_empty
    if earlier:
        direct_io.crc32 = zlib.crc32
        direct_io.aligned_empty = shared_empty
    gc.collect()  # the previous restore's buffers, which jax frees when Python's gc runs
    try:
        r0, t = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
        got = checkpoint.Checkpointer(root, read_only=True).restore(target)
        jax.block_until_ready(got.state)
        wall, r1 = time.perf_counter() - t, resource.getrusage(resource.RUSAGE_SELF)
    finally:
        direct_io.crc32, direct_io.aligned_empty = real_crc, real_empty
    del got
    return {
        "GB_per_s": round(GIB / wall / 1e9, 3),
        "user_s": round(r1.ru_utime - r0.ru_utime, 2),
        "sys_s": round(r1.ru_stime - r0.ru_stime, 2),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    state = make_state()
    d = Path(tempfile.mkdtemp(dir=Path(args.dir).absolute()))
    try:
        c = checkpoint.Checkpointer(d / "ckpt", keep=None, async_save=False)
        c.save(1, state)
        c.close()
        target = abstract(state)
        del state
        for rep in range(args.reps):
            out = {"rep": rep + 1, "load_avg_1min": round(os.getloadavg()[0], 1)}
            out["dd_oflag_direct"] = dd(d, ["if=/dev/zero", f"of={d / 'dd.bin'}", "oflag=direct"])
            out["dd_iflag_direct"] = dd(d, [f"if={d / 'dd.bin'}", "of=/dev/null", "iflag=direct"])
            sd = d / "ckpt" / "1" / "state"
            for mapping in MAPPINGS:
                out[f"stages_{mapping}"] = stages(sd, mapping)
            order = (("restore_earlier", True), ("restore_now", False))
            for name, earlier in order if rep % 2 == 0 else order[::-1]:  # each goes first every other rep
                r = restore(d / "ckpt", target, earlier)
                out[name] = dict(r, vs_dd=round(r["GB_per_s"] / out["dd_oflag_direct"], 3))
            print(json.dumps(out), flush=True)
    finally:
        shutil.rmtree(d, ignore_errors=True)


if __name__ == "__main__":
    main()
