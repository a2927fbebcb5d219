"""One file per layer: the stacked leaves' slices of layer i, this process's shards, on disk.

    lf = LayerFiles.open(dirs, layout, owner="run-1")   # checks the dirs, claims them
    lf.write(i, buf)                                     # past the page cache, CRC kept
    lf.read(i, buf)                                      # the same bytes back, CRC checked

Layer i lives in `dirs[i % len(dirs)]` (striped), as `layer{i:05d}.p{process}.bin`: every
stored leaf's distinct shards of that layer (`Layout`), each at an offset aligned to
`direct_io.ALIGN`, so the whole file goes direct (O_DIRECT, as `dd oflag=direct`) from and
into page-aligned buffers (`direct_io.aligned_empty`) with no copy. The CRC-32 of each
write is kept in memory and checked on the next read (a changed or torn file is an
OffloadError naming it). These files are a working copy of the state, not a checkpoint:
they are written from the state at start (`fsdp_jax.nvme.step.NvmeStep.put`) and a
checkpoint is read out of them; after a crash the run resumes from its checkpoint and
rewrites them.

A claim file `fsdp_jax_nvme.p{process}.json` in each dir names the owner (the run) and
the layout's fingerprint; `open` refuses, before writing anything, a dir that is missing,
not a directory, not writable, holding another owner's or another shape's files, or
without room for its share of the layers (the bytes needed named). A dir on tmpfs / ramfs
is accepted with a warning: it is memory, not a disk.
"""

from __future__ import annotations

import dataclasses
import errno
import hashlib
import json
import os
import warnings
from pathlib import Path

import jax
import numpy as np

from fsdp_jax.checkpoint import direct_io
from fsdp_jax.errors import OffloadError

CLAIM = "fsdp_jax_nvme{}.p{}.json"  # the kind (".params", ... or ""), the process
LAYER = "{}{:05d}.p{}.bin"  # the kind or "layer", the layer, the process
MEMORY_FS = frozenset({"tmpfs", "ramfs", "devtmpfs"})


@dataclasses.dataclass(frozen=True)
class Entry:
    """One distinct shard of one stored leaf's layer slice, at `offset` in the layer's file."""

    leaf: int
    devices: tuple  # the local devices holding this shard
    shape: tuple[int, ...]  # the shard's shape (dim 0 = 1: one layer)
    dtype: np.dtype
    offset: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Layout:
    """Where each stored leaf's shards sit in one layer's buffer (this process)."""

    n_layers: int
    shapes: tuple[tuple[int, ...], ...]  # per stored leaf: one layer's global shape (1, ...)
    shardings: tuple  # per stored leaf: its NamedSharding (the stacked leaf's spec)
    entries: tuple[Entry, ...]
    nbytes: int  # one layer's file (a multiple of ALIGN)

    @classmethod
    def of(cls, stacked, names=None) -> "Layout":
        """The layout of `stacked` (sharded ShapeDtypeStructs / arrays, dim 0 = layers, all
        the same count). Raises OffloadError when a leaf shards its layer dim."""
        n = {x.shape[0] for x in stacked}
        if len(n) != 1:
            raise OffloadError(f"offload: nvme needs one layer count over the stacked leaves, got {sorted(n)}")
        entries, shapes, off = [], [], 0
        for k, x in enumerate(stacked):
            shape = (1, *x.shape[1:])
            by_index: dict = {}
            for d, idx in x.sharding.addressable_devices_indices_map(x.shape).items():
                if (idx[0].start or 0) != 0 or (idx[0].stop or x.shape[0]) != x.shape[0]:
                    name = names[k] if names else f"leaf {k}"
                    raise OffloadError(
                        f"offload: nvme streams whole layers, but {name} {tuple(x.shape)} shards its layer dim "
                        f"({x.sharding.spec}); keep dim 0 unsharded"
                    )
                by_index.setdefault(tuple((s.start, s.stop) for s in idx[1:]), []).append(d)
            for devs in by_index.values():
                sh = x.sharding.shard_shape(x.shape)
                sh = (1, *sh[1:])
                nb = int(np.prod(sh, dtype=np.int64)) * np.dtype(x.dtype).itemsize
                entries.append(Entry(k, tuple(devs), sh, np.dtype(x.dtype), off, nb))
                off += -(-nb // direct_io.ALIGN) * direct_io.ALIGN
            shapes.append(shape)
        nbytes = max(off, direct_io.ALIGN)
        return cls(n.pop(), tuple(shapes), tuple(x.sharding for x in stacked), tuple(entries), nbytes)

    def fingerprint(self) -> str:
        spec = [(e.leaf, e.shape, str(e.dtype), e.offset) for e in self.entries]
        text = json.dumps([self.n_layers, [list(s) for s in self.shapes], repr(spec)])
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def to_arrays(self, buf: np.ndarray, copy: bool = False) -> list[jax.Array]:
        """Per stored leaf, one layer's array (1, ...) sharded as the leaf, from `buf`. On CPU
        the arrays may alias `buf` (a zero-copy `device_put`): pass `copy` to keep them past
        the buffer's next use."""
        per_leaf: list[list] = [[] for _ in self.shapes]
        for e in self.entries:
            view = buf[e.offset : e.offset + e.nbytes].view(e.dtype).reshape(e.shape)
            view = view.copy() if copy else view
            per_leaf[e.leaf] += [jax.device_put(view, d) for d in e.devices]
        return [
            jax.make_array_from_single_device_arrays(shape, s, arrs)
            for shape, s, arrs in zip(self.shapes, self.shardings, per_leaf)
        ]

    def stacked_on_host(self, files: "LayerFiles", buf: np.ndarray, memory_kind: str) -> list[jax.Array]:
        """Per stored leaf, the whole stack (n_layers, ...) sharded as the leaf in memory
        `memory_kind` (host memory: a checkpoint's source), each layer file read once into
        `buf`; host memory holds the stacks once more while each leaf is placed."""
        stacks = [np.empty((self.n_layers, *e.shape[1:]), e.dtype) for e in self.entries]
        for i in range(self.n_layers):
            files.read(i, buf)
            for e, st in zip(self.entries, stacks):
                st[i] = buf[e.offset : e.offset + e.nbytes].view(e.dtype).reshape(e.shape[1:])
        out = []
        for k, (shape, s) in enumerate(zip(self.shapes, self.shardings)):
            kind = s.with_memory_kind(memory_kind)
            arrs = [
                jax.device_put(st, jax.sharding.SingleDeviceSharding(d, memory_kind=memory_kind))
                for e, st in zip(self.entries, stacks)
                if e.leaf == k
                for d in e.devices
            ]
            out.append(jax.make_array_from_single_device_arrays((self.n_layers, *shape[1:]), kind, arrs))
            for j, e in enumerate(self.entries):
                if e.leaf == k:
                    stacks[j] = None  # placed: the host copy goes
        return out

    def from_arrays(self, arrays, buf: np.ndarray) -> None:
        """Copy one layer's arrays (per stored leaf, as `to_arrays` gives) into `buf`."""
        shards = [{s.device: s for s in a.addressable_shards} for a in arrays]
        for e in self.entries:
            data = np.asarray(shards[e.leaf][e.devices[0]].data)
            buf[e.offset : e.offset + e.nbytes] = data.reshape(-1).view(np.uint8)


def fs_type(path: Path) -> str:
    """The file system type of the mount holding `path` (from /proc/mounts; '' if unknown)."""
    best, kind = "", ""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return ""
    real = str(path.resolve())
    for line in lines:
        parts = line.split()
        if len(parts) > 2:
            mnt = parts[1].replace("\\040", " ")
            if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                best, kind = mnt, parts[2]
    return kind


@dataclasses.dataclass
class LayerFiles:
    """The layer files of one process over `dirs` (see the module docstring)."""

    dirs: tuple[Path, ...]
    layout: Layout
    owner: str
    process: int = 0
    crcs: dict = dataclasses.field(default_factory=dict)
    kind: str = ""  # several sets of files in one dir ("params", "state", "grads"): their names

    @classmethod
    def open(cls, dirs, layout: Layout, owner: str, process: int | None = None, kind: str = "") -> "LayerFiles":
        """Check and claim `dirs` for `layout` (see the module docstring); nothing is
        written before every check has passed. `kind` names one set of files among several
        in the same dirs (`{kind}00000.p0.bin`, claim `fsdp_jax_nvme.{kind}.p0.json`)."""
        return cls.open_sets(dirs, {kind: layout}, owner, process)[kind]

    @classmethod
    def open_sets(cls, dirs, layouts: dict, owner: str, process: int | None = None) -> dict:
        """`open` of several sets of files in the same dirs ({kind: Layout} -> {kind: LayerFiles}):
        every set's checks pass, and the dirs have room for all of them together, before any
        claim is written."""
        if not dirs:
            raise OffloadError("offload_dirs: nvme offload needs at least one directory (offload_dirs=[/path, ...])")
        proc = jax.process_index() if process is None else process
        paths = tuple(Path(d) for d in dirs)
        for p in paths:
            _check_dir(p)
        sets = {kind: cls(paths, layout, owner, proc, kind=kind) for kind, layout in layouts.items()}
        for lf in sets.values():
            for p in paths:
                lf._check_claim(p)
        _check_space(list(sets.values()))
        for p in paths:
            if fs_type(p) in MEMORY_FS:
                warnings.warn(f"offload_dirs: {p} is on {fs_type(p)}: memory, not a disk", stacklevel=3)
        for lf in sets.values():
            claim = {"owner": owner, "fingerprint": lf.layout.fingerprint(), "layers": lf.layout.n_layers}
            for p in paths:
                _atomic_write(p / lf.claim_name(), json.dumps(claim))
        return sets

    def _check_claim(self, d: Path) -> None:
        claim = d / self.claim_name()
        if claim.exists():
            got = json.loads(claim.read_text())
            if got.get("owner") != self.owner:
                raise OffloadError(
                    f"offload_dirs: {d} holds the nvme files of another run ({got.get('owner')!r}, this is "
                    f"{self.owner!r}); give this run its own dir or remove them"
                )
            if got.get("fingerprint") != self.layout.fingerprint():
                raise OffloadError(
                    f"offload_dirs: {d} holds this run's nvme files for another state shape "
                    f"({got.get('layers')} layers, fingerprint {got.get('fingerprint')}); remove them to start over"
                )
        elif any(d.glob(LAYER.format(self.kind or "layer", 0, self.process).replace("00000", "*"))):
            raise OffloadError(f"offload_dirs: {d} holds layer files with no claim (another run's?); nothing written")

    def claim_name(self) -> str:
        return CLAIM.format(f".{self.kind}" if self.kind else "", self.process)

    def path(self, i: int) -> Path:
        return self.dirs[i % len(self.dirs)] / LAYER.format(self.kind or "layer", i, self.process)

    def write(self, i: int, buf: np.ndarray) -> None:
        """Layer i's file from `buf` (aligned, `layout.nbytes`), its CRC kept."""
        try:
            crc, _ = direct_io.write_file(self.path(i), buf)  # buf is aligned: no pad
        except OSError as e:
            what = "the disk is full" if e.errno in (errno.ENOSPC, errno.EDQUOT) else e.strerror
            raise OSError(e.errno, f"offload_dirs: writing {self.path(i)}: {what}") from None
        self.crcs[i] = crc

    def read(self, i: int, buf: np.ndarray) -> np.ndarray:
        """Layer i's file into `buf`, its size and CRC checked against the last write."""
        try:
            crc, got = direct_io.read_file(self.path(i), buf)
        except OSError as e:
            raise OSError(e.errno, f"offload_dirs: reading {self.path(i)}: {e.strerror}") from None
        if got != self.layout.nbytes or crc != self.crcs.get(i):
            raise OSError(
                errno.EIO,
                f"offload_dirs: {self.path(i)} changed under the run ({got} bytes, CRC {crc}, "
                f"written {self.layout.nbytes} bytes, CRC {self.crcs.get(i)}); resume from the last checkpoint",
            )
        return buf

    def buffer(self) -> np.ndarray:
        return direct_io.aligned_empty((self.layout.nbytes,), np.uint8)

    def disk_bytes(self) -> int:
        return self.layout.n_layers * self.layout.nbytes


def _check_space(sets: list[LayerFiles]) -> None:
    """OffloadError unless each file system has room for every set's layer files (less what they hold now)."""
    need: dict[int, list] = {}
    for lf in sets:
        for i in range(lf.layout.n_layers):
            d = lf.path(i).parent
            have = lf.path(i).stat().st_size if lf.path(i).exists() else 0
            need.setdefault(os.stat(d).st_dev, [d, 0])[1] += lf.layout.nbytes - have
    for d, nbytes in need.values():
        st = os.statvfs(d)
        free = st.f_bavail * st.f_frsize
        if nbytes > free:
            what = "its layers' state" if len(sets) == 1 else f"its layers' {', '.join(lf.kind for lf in sets)}"
            raise OffloadError(
                f"offload_dirs: {d} needs {nbytes} bytes ({nbytes / 1e9:.2f} GB) for {what}, "
                f"but has {free} free; add dirs or free space"
            )


def _check_dir(p: Path) -> None:
    if not p.exists():
        raise OffloadError(f"offload_dirs: {p} does not exist; create it (a local NVMe mount) or name another")
    if not p.is_dir():
        raise OffloadError(f"offload_dirs: {p} is not a directory")
    probe = p / f".fsdp_jax_probe.{os.getpid()}"
    try:  # os.access says yes to root on a read-only mount
        probe.write_bytes(b"")
        probe.unlink()
    except OSError as e:
        raise OffloadError(f"offload_dirs: {p} is not writable ({e.strerror})") from None


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    except OSError as e:
        raise OffloadError(f"offload_dirs: writing {path}: {e.strerror}") from None
