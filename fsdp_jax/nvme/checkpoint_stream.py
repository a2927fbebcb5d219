"""A checkpoint of an nvme run streamed layer by layer out of the layer files, and a restore
that rebuilds the layer files layer by layer out of the checkpoint.

    saved = live.replace(opt_state=with_stacks(...))   # `NvmeStep.to_save`: Streamed leaves
    checkpointer.save(step, saved, extras)             # the stacked leaves' shard files written
                                                       # from the layer files, a layer at a time
    rebuild(files, layout, names, state_dir, buffers)  # `NvmeStep.put_restored`: layer i of every
                                                       # stacked leaf read from the checkpoint's
                                                       # shard files into layer i's file

Save: each stacked leaf of the checkpoint (`shard_files`' format: one file per distinct
shard, C order, dim 0 = layers, unsharded) is a `LayerStack` (`shard_files.Streamed`); the
one `StackWriter` they share reads layer file i (the next one is read while this one is
written) and appends each shard's layer-i bytes to that shard's checkpoint file at
`i x the shard's layer bytes`, past the page cache (O_DIRECT) where the bytes are whole blocks,
the CRC-32 of each file computed on the way. Host memory: the two layer buffers, not the
stacked state (that was `gather`'s 622.78 GB per node for Llama-2-70B). The files are written
in the save's background commit, like the rest of the state, so the next step's forward and
backward overlap them; its update (which rewrites the layer files) waits for `done`
(`NvmeStep`), checking the checkpointer for a failed save while it waits.

Restore: the checkpoint restores with the stacked leaves `shard_files.Unread`; `rebuild`
then reads, per layer, layer i's rows of each saved shard file that overlaps this process's
shards (so a checkpoint from another mesh or another offload setting restores too), checks
every file's CRC-32 once all its rows are read, and writes layer file i. Host memory: one
layer of the saved shards and one layer buffer.
"""

from __future__ import annotations

import concurrent.futures as cf
import os
import threading
from pathlib import Path

import numpy as np

from fsdp_jax.checkpoint import direct_io, shard_files
from fsdp_jax.errors import ShardFileError
from fsdp_jax.nvme.layer_files import LayerFiles, Layout


def _start(layout: Layout, k: int, e) -> tuple[int, ...]:
    """The global start of entry `e`'s shard of stored leaf `k` (dim 0: layer 0)."""
    shape = (layout.n_layers, *layout.shapes[k][1:])
    idx = layout.shardings[k].addressable_devices_indices_map(shape)[e.devices[0]]
    return tuple(0 if s.start is None else int(s.start) for s in idx)


class LayerStack(shard_files.Streamed):
    """Stored leaf `k` of `layout` (the whole stack) as a `shard_files.Streamed` leaf."""

    def __init__(self, writer: "StackWriter", k: int):
        lay = writer.layout
        self.writer, self.k = writer, k
        self.shape = (lay.n_layers, *lay.shapes[k][1:])
        self.entries = [e for e in lay.entries if e.leaf == k]
        self.dtype = self.entries[0].dtype

    def bounds(self):
        out = []
        for e in self.entries:
            start = _start(self.writer.layout, self.k, e)
            out.append((start, tuple(a + (n if d else self.shape[0]) for d, (a, n) in enumerate(zip(start, e.shape)))))
        return out


class StackWriter:
    """Writes `LayerStack` shards from `files` (see the module docstring); `buffers`: two
    layer buffers, `reader`: a one-thread executor for the read-ahead."""

    def __init__(self, files: LayerFiles, buffers, reader: cf.Executor):
        self.files, self.layout, self.buffers, self.reader = files, files.layout, buffers, reader
        self.done, self.error = threading.Event(), None  # set when `write` has ended (error: why not)

    def wait(self, check=None, poll: float = 0.5) -> None:
        """Until `write` has ended; `check()` (raising on a failed save) every `poll` seconds
        meanwhile, so a save that fails before it writes does not block forever."""
        while not self.done.wait(poll):
            if check is not None:
                check()
        if self.error is not None and check is not None:
            check()

    def stacks(self) -> list[LayerStack]:
        return [LayerStack(self, k) for k in range(len(self.layout.shapes))]

    def write(self, directory: Path, jobs) -> dict[str, tuple[str, int]]:
        try:
            return self._write(directory, jobs)
        except BaseException as e:
            self.error = e
            raise
        finally:
            self.done.set()

    def _write(self, directory: Path, jobs) -> dict[str, tuple[str, int]]:
        outs = []  # [entry, fd, CRC so far, file name]
        try:
            for leaf, j, name in jobs:
                e = leaf.entries[j]
                fd, _ = (direct_io.open_direct if e.nbytes % direct_io.ALIGN == 0 else _plain)(
                    directory / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC
                )
                outs.append([e, fd, 0, name])
            n = self.layout.n_layers
            reading = self.reader.submit(self.files.read, 0, self.buffers[0])
            for i in range(n):
                buf = reading.result()
                if i + 1 < n:
                    reading = self.reader.submit(self.files.read, i + 1, self.buffers[(i + 1) % 2])
                for out in outs:
                    e = out[0]
                    view = memoryview(buf[e.offset : e.offset + e.nbytes])
                    out[2] = direct_io.crc32(view, out[2])
                    direct_io.write_all(out[1], view, i * e.nbytes)
            for _, fd, _, _ in outs:
                os.fsync(fd)
                if hasattr(os, "posix_fadvise"):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            for out in outs:
                os.close(out[1])
        return {name: (f"{crc:08x}", 0) for _, _, crc, name in outs}


def _plain(path, flags):
    return os.open(path, flags, 0o644), False


def rebuild(files: LayerFiles, names: list[str], state_dir: Path, buf: np.ndarray) -> None:
    """Every layer file of `files` from the checkpoint's shard files in `state_dir` (its
    stacked leaves named `names`, as `shard_files` names them), a layer at a time (module
    docstring). ShardFileError names a file that is missing, resized or changed."""
    lay, index = files.layout, shard_files.read_index(state_dir)
    crcs: dict[str, list] = {}  # file -> [CRC so far, bytes so far, its index entry]
    for i in range(lay.n_layers):
        loaded: dict[str, np.ndarray] = {}
        for e in lay.entries:
            m = index[names[e.leaf]]
            start = (i, *_start(lay, e.leaf, e)[1:])
            stop = tuple(a + n for a, n in zip(start, e.shape))
            parts = shard_files.overlaps(m["files"], start, stop)
            layer = []
            for f in parts:
                if f["file"] not in loaded:
                    loaded[f["file"]] = _read_row(state_dir, f, i, np.dtype(m["dtype"]), crcs)
                layer.append(dict(f, start=[i, *f["start"][1:]], stop=[i + 1, *f["stop"][1:]]))
            block = shard_files.region(start, stop, layer, loaded, e.dtype)
            buf[e.offset : e.offset + e.nbytes] = np.ascontiguousarray(block).reshape(-1).view(np.uint8)
        files.write(i, buf)
    for name, (crc, got, f) in crcs.items():
        if got != f["bytes"] or f"{crc:08x}" != f["crc32"]:
            raise ShardFileError(
                f"{state_dir.name}/{name} has changed since it was saved (CRC-32 {crc:08x} over {got} bytes, "
                f"{f['crc32']} over {f['bytes']} when saved)"
            )


def _read_row(state_dir: Path, f: dict, i: int, dtype: np.dtype, crcs: dict) -> np.ndarray:
    """Layer i's rows of the saved shard file `f` (dim 0 from f's start), its CRC-32 carried on."""
    shape = [b - a for a, b in zip(f["start"], f["stop"])]
    row = int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize
    pad, path = f.get("offset", 0), state_dir / f["file"]
    if f["file"] not in crcs:
        crc, got = _read_at(path, direct_io.aligned_empty((pad,), np.uint8), 0) if pad else (0, 0)
        crcs[f["file"]] = [crc, got, f]
    out = direct_io.aligned_empty((row,), np.uint8)
    try:
        crc, got = _read_at(path, out, pad + (i - f["start"][0]) * row)
    except FileNotFoundError:
        raise ShardFileError(f"{state_dir.name}/{f['file']} is missing") from None
    if got != row:
        raise ShardFileError(f"{state_dir.name}/{f['file']} is shorter than when saved")
    c = crcs[f["file"]]
    c[0], c[1] = direct_io.crc32_combine(c[0], crc, got), c[1] + got
    return out.view(dtype).reshape([1, *shape[1:]])


def _read_at(path: Path, out: np.ndarray, lo: int) -> tuple[int, int]:
    """File bytes [lo, lo + out.nbytes) into `out` (aligned); (their CRC-32, bytes read). Past
    the page cache where the offset and size are whole blocks."""
    view = memoryview(out.reshape(-1).view(np.uint8))
    whole = lo % direct_io.ALIGN == 0 and len(view) % direct_io.ALIGN == 0
    fd, _ = direct_io.open_direct(path, os.O_RDONLY) if whole else _plain(path, os.O_RDONLY)
    crc, got = 0, 0
    try:
        while got < len(view):
            n = os.preadv(fd, [view[got : got + direct_io.CHUNK]], lo + got)
            if not n:
                break
            crc, got = direct_io.crc32(view[got : got + n], crc), got + n
    finally:
        os.close(fd)
    return crc, got
