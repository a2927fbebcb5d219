"""Host memory of an nvme run's checkpoint: streamed layer by layer vs assembled in memory.

    python benchmarks/nvme_checkpoint.py --dir DIR [--gb 3] [--layers 24]

On 8 CPU devices, a stacked optimizer state of `--gb` GB (two f32 leaves, Adam's mu and nu,
of shape (layers, d, d) sharded over `fsdp` on dim 1) lives in `--layers` layer files under
DIR (`fsdp_jax.nvme.LayerFiles`, as `optimizer:nvme` keeps it). Then, in this one process:

1. save: `Checkpointer.save` of the stacked leaves as `checkpoint_stream.LayerStack`s (what
   `NvmeStep.to_save` hands the trainer's checkpointer), waited for;
2. restore: `Checkpointer.restore` onto `shard_files.Unread` targets, then
   `checkpoint_stream.rebuild` writes every layer file again from the checkpoint, checked
   against the values written in step 0;
3. gather (the path it replaces, for scale): `Layout.stacked_on_host`, the whole stack in
   host memory.

Per phase: seconds, GB/s of state moved, the process's resident memory (VmRSS, sampled every
5 ms) at the start and its peak, and the peak over the start. DIR is emptied at the end.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import os
import shutil
import threading
import time
from pathlib import Path

import jax

jax.config.update("jax_num_cpu_devices", 8)

import numpy as np  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import fsdp_jax as fj  # noqa: E402
from fsdp_jax.checkpoint import Checkpointer, shard_files  # noqa: E402
from fsdp_jax.nvme import LayerFiles, Layout  # noqa: E402
from fsdp_jax.nvme.checkpoint_stream import StackWriter, rebuild  # noqa: E402


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


class Peak:
    """The peak VmRSS while the `with` block runs (sampled every 5 ms)."""

    def __enter__(self):
        self.start, self.peak, self._stop = rss(), rss(), threading.Event()
        self._t = threading.Thread(target=self._watch, daemon=True)
        self._t.start()
        self.t0 = time.perf_counter()
        return self

    def _watch(self):
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, rss())

    def __exit__(self, *exc):
        self.seconds = time.perf_counter() - self.t0
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss())


def layer_values(lay: Layout, i: int, buf: np.ndarray) -> None:
    """Layer i of every leaf: the value i + leaf / 10 everywhere (checkable after a round trip)."""
    for e in lay.entries:
        buf[e.offset : e.offset + e.nbytes].view(e.dtype)[:] = i + e.leaf / 10


def report(name: str, p: Peak, nbytes: int) -> None:
    print(
        f"{name:8s} {p.seconds:7.1f} s  {nbytes / p.seconds / 1e9:5.2f} GB/s  RSS at start {p.start / 1e9:5.2f} GB  "
        f"peak {p.peak / 1e9:5.2f} GB  peak - start {(p.peak - p.start) / 1e9:5.2f} GB",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", required=True, type=Path)
    ap.add_argument("--gb", type=float, default=3.0)
    ap.add_argument("--layers", type=int, default=24)
    a = ap.parse_args()
    d = int((a.gb * 1e9 / (a.layers * 2 * 4)) ** 0.5) // 64 * 64
    mesh = fj.make_mesh(fsdp=8)
    spec = [
        jax.ShapeDtypeStruct((a.layers, d, d), np.float32, sharding=NamedSharding(mesh, P(None, "fsdp")))
        for _ in range(2)
    ]
    lay = Layout.of(spec)
    total = lay.n_layers * lay.nbytes
    work = [a.dir / n for n in ("nvme", "ckpt", "nvme2")]
    for w in work:
        w.mkdir(parents=True, exist_ok=True)
    print(
        f"state {total / 1e9:.2f} GB: 2 leaves of ({a.layers}, {d}, {d}) f32 on 8 devices, one layer {lay.nbytes / 1e6:.1f} MB"
    )
    try:
        files = LayerFiles.open([work[0]], lay, owner="bench")
        buf = files.buffer()
        with Peak() as p:
            for i in range(lay.n_layers):
                layer_values(lay, i, buf)
                files.write(i, buf)
        report("fill", p, total)
        ckpt = Checkpointer(work[1])
        with Peak() as p, cf.ThreadPoolExecutor(1) as ex:
            stacks = StackWriter(files, [files.buffer(), files.buffer()], ex).stacks()
            ckpt.save(1, {"opt_state": {"mu": stacks[0], "nu": stacks[1]}})
            ckpt.wait()
        report("save", p, total)
        del stacks
        files2 = LayerFiles.open([work[2]], lay, owner="bench2")
        with Peak() as p:
            target = {"opt_state": {k: shard_files.Unread(x.shape, x.dtype) for k, x in zip(("mu", "nu"), spec)}}
            ckpt.restore(target)
            rebuild(files2, ["opt_state/mu", "opt_state/nu"], ckpt.step_dir(1) / "state", files2.buffer())
        report("restore", p, total)
        want = files.buffer()
        for i in range(lay.n_layers):
            layer_values(lay, i, want)
            assert np.array_equal(files2.read(i, buf), want), f"layer {i} differs after the round trip"
        ckpt.close()
        with Peak() as p:
            stacked = lay.stacked_on_host(files, buf, "pinned_host")
            jax.block_until_ready(stacked)
        report("gather", p, total)
    finally:
        for w in work:
            shutil.rmtree(w, ignore_errors=True)
    print(f"cpu {os.times().user + os.times().system:.1f} s")


if __name__ == "__main__":
    main()
