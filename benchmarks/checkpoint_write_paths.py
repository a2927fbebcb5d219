#!/usr/bin/env python
"""Where a checkpoint save's time goes: the disk's direct-write bandwidth and each write path, side by side.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/checkpoint_write_paths.py --dir DIR [--reps 2] [--orbax-handlers] [--drop-caches]

One float32 state of 1 GiB (8 leaves, each sharded over 8 CPU devices), per repetition and in
this order on the same disk, so that a busy machine slows every path alike:
`dd if=/dev/zero bs=16M count=64 oflag=direct` (the disk's direct-write bandwidth) and the
same file read back with `iflag=direct`; `fsdp_jax.checkpoint.Checkpointer` saving
synchronously (files, CRC-32 manifest, atomic commit) with `payload="shards"` (raw shard
files, `fsdp_jax.checkpoint.shard_files`), then restoring it (manifest check, reads, CRC-32
verification, arrays on the 8 devices); the same save from the state in `pinned_host`
memory (offloaded: no device round trip); then `payload="orbax"` (Orbax OCDBT) saved and
restored. With --drop-caches the page cache is emptied before dd's read and each restore
(`drop_page_cache`; the output says what was done). With --orbax-handlers also Orbax's
PyTreeCheckpointHandler with OCDBT, without, with OCDBT + zarr3, and a raw write of every
shard to its own file with fsync. Prints one JSON line of GB/s per path (1 GB = 1e9 bytes),
one value per repetition, each Checkpointer path's ratio to that repetition's dd, and the
1-minute load average as each repetition began. Each path is timed from a collected heap
(`gc.collect()` first: jax frees the buffers of dropped arrays, such as the previous restore's
1 GiB, when Python's gc runs). DIR must be on the disk to measure; everything written there is
removed.
"""

from __future__ import annotations

import argparse
import gc
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
    return jax.block_until_ready({f"w{i}": make(jax.random.key(i)) for i in range(8)})


def timed(fn, nbytes: int) -> float:
    """GB/s of `fn()` over `nbytes`, from a collected heap: the previous path's garbage (and the
    buffers jax frees only when Python's gc runs: `jax._src.lib._xla_gc_callback`) is freed
    before the clock starts, not inside whichever path's allocations trigger the next gc."""
    gc.collect()
    t = time.perf_counter()
    fn()
    return round(nbytes / (time.perf_counter() - t) / 1e9, 3)


def dd(d: Path, direction: str = "write") -> None:
    f = d / "dd.bin"
    cmd = (
        ["if=/dev/zero", f"of={f}", "oflag=direct"]
        if direction == "write"
        else [f"if={f}", "of=/dev/null", "iflag=direct"]
    )
    subprocess.run(["dd", *cmd, "bs=16M", "count=64"], check=True, capture_output=True)


NOT_DROPPED = "not dropped: O_DIRECT reads (files written with O_DIRECT, their sub-page tails dropped after fsync)"


def drop_page_cache(drop: bool = True) -> str:
    """With `drop`, empty the page cache (`sync; echo 3 > /proc/sys/vm/drop_caches`) where this
    process may; returns what was done. Without it (or where not permitted) no read below is
    served from the cache either: the Checkpointer's and dd's reads are O_DIRECT, and the files
    are written with O_DIRECT or dropped from the cache after their fsync (POSIX_FADV_DONTNEED);
    only each file's sub-page tail and the JSON index and manifest are read through it."""
    if not drop:
        return NOT_DROPPED
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return "dropped (echo 3 > /proc/sys/vm/drop_caches)"
    except OSError:
        return "not permitted; " + NOT_DROPPED


def abstract(state, memory_kind: str | None = None):
    def one(x):
        s = x.sharding if memory_kind is None else x.sharding.with_memory_kind(memory_kind)
        return jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s)

    return jax.tree.map(one, state)


def checkpointer_paths(state, host_state) -> dict:
    """name -> fn(dir): each Checkpointer payload's synchronous save (files, CRC-32 manifest,
    commit), then its restore (manifest check + read + CRC verification) onto the same layout."""
    from fsdp_jax import checkpoint

    Checkpointer = checkpoint.Checkpointer  # imports Orbax (~2 s, once per process) before any path is timed

    def save(payload, st):
        def fn(d):
            c = Checkpointer(d / payload, keep=None, async_save=False, payload=payload)
            c.save(1, st)
            c.close()

        return fn

    def restore(payload, st):
        def fn(d):
            c = Checkpointer(d / payload, read_only=True)
            jax.block_until_ready(c.restore(abstract(st)).state)

        return fn

    return {
        "save_shards": save("shards", state),
        "restore_shards": restore("shards", state),
        "save_shards_from_pinned_host": save("shards", host_state),
        "save_orbax": save("orbax", state),
        "restore_orbax": restore("orbax", state),
    }


def other_paths(state) -> dict:
    import orbax.checkpoint as ocp

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
        "orbax_ocdbt": orbax(use_ocdbt=True),
        "orbax_no_ocdbt": orbax(use_ocdbt=False),
        "orbax_ocdbt_zarr3": orbax(use_ocdbt=True, use_zarr3=True),
        "raw_fsync": raw,
    }


def one_rep(state, host_state, where: Path, others: bool, drop: bool) -> dict[str, float]:
    nbytes = sum(x.nbytes for x in state.values())
    d = Path(tempfile.mkdtemp(dir=where)).absolute()
    out = {"load_avg_1min": os.getloadavg()[0]}
    try:
        out["dd_oflag_direct"] = timed(lambda: dd(d), GIB)
        out["page_cache"] = drop_page_cache(drop)
        out["dd_read_iflag_direct"] = timed(lambda: dd(d, "read"), GIB)
        for name, fn in checkpointer_paths(state, host_state).items():
            if name == "save_shards_from_pinned_host":
                shutil.rmtree(d / "shards")
            if name.startswith("restore"):
                drop_page_cache(drop)
            out[name] = timed(lambda: fn(d), nbytes)
        for name, fn in (other_paths(state) if others else {}).items():
            sub = d / name
            sub.mkdir()
            out[name] = timed(lambda: fn(sub), nbytes)
    finally:
        shutil.rmtree(d, ignore_errors=True)
    for k in ("save_shards", "restore_shards", "save_shards_from_pinned_host", "save_orbax", "restore_orbax"):
        out[f"{k}_vs_dd"] = round(out[k] / out["dd_oflag_direct"], 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, help="a directory on the disk to measure")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--orbax-handlers", action="store_true", help="also Orbax's handler variants and raw writes")
    ap.add_argument("--drop-caches", action="store_true", help="empty the page cache before each read (as root)")
    args = ap.parse_args()
    state = make_state()
    host_state = jax.device_put(state, jax.tree.map(lambda x: x.sharding.with_memory_kind("pinned_host"), state))
    jax.block_until_ready(host_state)
    out: dict[str, list] = {}
    for _ in range(args.reps):
        for k, v in one_rep(
            state, host_state, Path(args.dir).absolute(), args.orbax_handlers, args.drop_caches
        ).items():
            out.setdefault(k, []).append(round(v, 1) if k == "load_avg_1min" else v)
    page_cache = set(out.pop("page_cache"))
    print(json.dumps({"jax": jax.__version__, "page_cache": sorted(page_cache), "GB_per_s": out}))


if __name__ == "__main__":
    main()
