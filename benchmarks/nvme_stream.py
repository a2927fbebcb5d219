"""Stream an optimizer state through the nvme update's I/O pipeline, beside `dd` on the same disk.

    python benchmarks/nvme_stream.py --dir DIR [--gb 2.5] [--layers 20]

The state (f32 params + Adam mu, nu: 12 bytes per parameter; `--gb` of them) is split
into `--layers` layers, each one file written and read by `fsdp_jax.nvme.LayerFiles`
(O_DIRECT, CRC-32); then one pass of the streamed update's pipeline (read layer i+1 |
update i: an elementwise Adam step in a jitted program on 1 device | write i-1, three
host buffers) as `NvmeStep._update_layers` runs it. Beside it, on the same DIR, `dd
oflag=direct` writes and `dd iflag=direct` reads a file of the same total size, one after
the other and then both at once (a read and a write in flight together, as in the pipeline).
To say where the time goes it also times: the layer files read one after another, the
pipeline's I/O alone (read i+1 | write i-1, no update, no copies) and CRC-32 over one layer
in memory. Prints GB/s of each and CPU seconds per GB moved (this process's user + system
time). DIR is emptied of this benchmark's files at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import re
import subprocess
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from fsdp_jax.checkpoint.direct_io import crc32
from fsdp_jax.nvme import LayerFiles, Layout


def _dd(args: list[str]) -> float:
    out = subprocess.run(["dd", *args], capture_output=True, text=True, check=True).stderr
    m = re.search(r"copied, ([\d.]+) s", out)
    return float(m.group(1))


def _dd_both(read: list[str], write: list[str]) -> float:
    """Wall seconds of a dd read and a dd write running at the same time."""
    t0 = time.perf_counter()
    procs = [subprocess.Popen(["dd", *a], stderr=subprocess.DEVNULL) for a in (read, write)]
    for p in procs:
        if p.wait():
            raise subprocess.CalledProcessError(p.returncode, "dd")
    return time.perf_counter() - t0


def _cpu() -> float:
    t = os.times()
    return t.user + t.system


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--gb", type=float, default=2.5)
    ap.add_argument("--layers", type=int, default=20)
    a = ap.parse_args()
    d = Path(a.dir)
    per_layer = int(a.gb * 1e9 / a.layers / 12) // 1024 * 1024  # params per layer
    s = SingleDeviceSharding(jax.devices()[0])
    stacked = [jax.ShapeDtypeStruct((a.layers, per_layer), jnp.float32, sharding=s) for _ in range(3)]
    lay = Layout.of(stacked)
    files = LayerFiles.open([d], lay, owner="nvme_stream benchmark")
    total = lay.nbytes * a.layers
    bufs = [files.buffer() for _ in range(3)]
    rng = np.random.default_rng(0)
    bufs[0][:] = rng.integers(0, 64, lay.nbytes, dtype=np.uint8)  # finite small floats
    t0 = time.perf_counter()
    for i in range(a.layers):
        files.write(i, bufs[0])
    t_init = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(a.layers):
        files.read(i, bufs[1])
    t_read = time.perf_counter() - t0
    t0 = time.perf_counter()
    crc32(bufs[1])
    t_crc = time.perf_counter() - t0
    t_io = _io_only(files, bufs, a.layers)
    grads = jnp.full((1, per_layer), 1e-3, jnp.float32)

    @jax.jit
    def adam(p, m, v, g):
        m = 0.9 * m + 0.1 * g
        v = 0.999 * v + 0.001 * g * g
        return p - 1e-3 * m / (jnp.sqrt(v) + 1e-8), m, v

    adam(*lay.to_arrays(bufs[1], copy=True), grads)  # compiled before the clock
    rx, wx = cf.ThreadPoolExecutor(1), cf.ThreadPoolExecutor(1)
    c0, t0 = _cpu(), time.perf_counter()
    free, reading, writing = list(bufs[1:]), rx.submit(files.read, 0, bufs[0]), None
    for i in range(a.layers):
        buf = reading.result()
        if i + 1 < a.layers:
            if not free:
                free.append(writing.result())
                writing = None
            reading = rx.submit(files.read, i + 1, free.pop())
        new = jax.block_until_ready(adam(*lay.to_arrays(buf), grads))
        if writing is not None:
            free.append(writing.result())
        lay.from_arrays(list(new), buf)
        writing = wx.submit(lambda i, b: (files.write(i, b), b)[1], i, buf)
    writing.result()
    t_step, c_step = time.perf_counter() - t0, _cpu() - c0
    big = d / "dd_probe.bin"
    count = total // (64 << 20)
    t_ddw = _dd(["if=/dev/zero", f"of={big}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync"])
    t_ddr = _dd([f"if={big}", "of=/dev/null", "bs=64M", f"count={count}", "iflag=direct"])
    dd_bytes = count * (64 << 20)
    big2 = d / "dd_probe2.bin"
    t_both = _dd_both(
        [f"if={big}", "of=/dev/null", "bs=64M", f"count={count}", "iflag=direct"],
        ["if=/dev/zero", f"of={big2}", "bs=64M", f"count={count}", "oflag=direct", "conv=fsync"],
    )
    big2.unlink()
    gb = total / 1e9
    print(f"state {gb:.2f} GB in {a.layers} layer files of {lay.nbytes / 1e6:.1f} MB; load average {os.getloadavg()}")
    print(f"layer files written, serial   {gb / t_init:6.2f} GB/s")
    print(f"layer files read, serial      {gb / t_read:6.2f} GB/s")
    print(f"CRC-32 of one layer in memory {lay.nbytes / 1e9 / t_crc:6.2f} GB/s")
    print(f"pipeline I/O alone: read+write {2 * gb / t_io:6.2f} GB/s moved ({gb / t_io:.2f} GB/s each way)")
    print(
        f"streamed update: read+write   {2 * gb / t_step:6.2f} GB/s moved ({gb / t_step:.2f} GB/s each way), "
        f"{t_step:.2f} s, CPU {c_step / (2 * gb):.2f} s per GB moved"
    )
    print(f"dd oflag=direct write         {dd_bytes / 1e9 / t_ddw:6.2f} GB/s")
    print(f"dd iflag=direct read          {dd_bytes / 1e9 / t_ddr:6.2f} GB/s")
    print(f"dd read and write at once     {2 * dd_bytes / 1e9 / t_both:6.2f} GB/s moved")
    dd_slow = dd_bytes / 1e9 / max(t_ddw, t_ddr)
    both = 2 * dd_bytes / 1e9 / t_both
    print(
        f"update pass vs dd: each way {gb / t_step / dd_slow:.0%} of dd's slower direction alone; bytes moved "
        f"{2 * gb / t_step / both:.0%} of dd reading and writing at once (pipeline I/O alone: {2 * gb / t_io / both:.0%})"
    )
    big.unlink()
    for i in range(a.layers):
        files.path(i).unlink()
    for p in d.glob("fsdp_jax_nvme.p*.json"):
        p.unlink()


def _io_only(files: LayerFiles, bufs, layers: int) -> float:
    """Seconds of the pipeline's reads and writes alone: read i+1 while i-1 is written (the
    same threads and buffers as the update pass, the update and copies left out)."""
    rx, wx = cf.ThreadPoolExecutor(1), cf.ThreadPoolExecutor(1)
    t0 = time.perf_counter()
    free, reading, writing = list(bufs[1:]), rx.submit(files.read, 0, bufs[0]), None
    for i in range(layers):
        buf = reading.result()
        if i + 1 < layers:
            if not free:
                free.append(writing.result())
                writing = None
            reading = rx.submit(files.read, i + 1, free.pop())
        if writing is not None:
            free.append(writing.result())
        writing = wx.submit(lambda i, b: (files.write(i, b), b)[1], i, buf)
    writing.result()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
