"""Arrays as raw shard files: each host-local shard of each array streamed to its own file.

    pieces = host_shards(state)                       # the device-to-host copies (blocking)
    write_shards(item_dir, pieces)                    # files + this process's index (any thread)
    restored = read_tree(item_dir, abstract_state)    # onto any mesh / sharding / memory kind

A save writes, for every array leaf, one file per distinct shard (the replica with
`replica_id == 0`, so a replicated leaf is written once over all processes): the shard's
bytes in C order, no header, past the page cache where the file system allows
(`direct_io`: O_DIRECT, as `dd oflag=direct`, in 64 MiB writes), CRC-32 computed over the
same bytes as they are written, one `fsync` per file. Each process writes `shards.<process>.json`
beside them: per leaf (by `manifest.tree_paths` name) its global shape and dtype, and per
file the shard's index ranges (`start`, `stop` per dim), the data's `offset` in the file
(`direct_io`'s pad), the file's bytes and its CRC-32. No pickle.

A restore builds each target leaf with `jax.make_array_from_callback`: the files that
overlap this process's shards of the target sharding are read whole (in parallel, in pieces
of up to `direct_io.PIECE` bytes, so several threads share a large file), their
CRC-32 and size checked against the index (a mismatch is a `ShardFileError` naming the file,
which the Checkpointer treats as a damaged step), and the needed slices cut out, cast to the
target dtype. So a checkpoint written on 8 devices restores onto 4, a 2x4 mesh, one device,
or into `pinned_host` memory; a process reads only the files its shards need.

Offloaded leaves (memory kind `pinned_host`) are written straight from host memory: their
shards are already host buffers, which `np.asarray` views without a copy; nothing goes to a
device. A `Streamed` leaf is not in memory at all: its owner writes its shard files itself
(`write_streamed`, in the save's commit; `fsdp_jax.nvme` streams them layer by layer out of
its layer files, which its next step leaves alone until then), and a restore target leaf `Unread` is checked but left to its owner to read.
"""

from __future__ import annotations

import concurrent.futures as cf
import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable, NamedTuple

import jax
import numpy as np

from fsdp_jax.checkpoint import direct_io
from fsdp_jax.checkpoint.manifest import SHARD_INDEX_GLOB, tree_paths
from fsdp_jax.errors import ShardFileError

WORKERS = 8  # files written / file pieces read at once (the CRC-32 and file I/O release the GIL)
AHEAD = 2  # leaves whose files are read while one is assembled
INDEX = "shards.{}.json"


class Piece(NamedTuple):
    path: str  # leaf name (`tree_paths`)
    file: str  # file name in the item directory
    start: tuple[int, ...]
    stop: tuple[int, ...]
    data: np.ndarray  # the shard, on the host, C-contiguous


class Written(NamedTuple):
    """A shard file its owner has written (`write_streamed`)."""

    crc32: str  # of the file's bytes, 8 hex digits
    pad: int  # bytes before the data
    nbytes: int  # the data's bytes


class Streamed:
    """A leaf to save whose shard files its owner writes (`fsdp_jax.nvme`: layer by layer out
    of its layer files, so host memory holds a few layers, not the leaf). Subclasses set
    `shape`, `dtype` and `writer`, and give `bounds()`: this process's distinct shards as
    (start, stop). `writer.write(directory, jobs)` writes every job `(leaf, shard number, file
    name)` of the leaves that share it in one call and returns {file name: (CRC-32, pad)}."""

    shape: tuple[int, ...]
    dtype: Any
    writer: Any

    def bounds(self) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
        raise NotImplementedError


class _Pending(NamedTuple):
    leaf: Streamed
    shard: int
    nbytes: int


@dataclasses.dataclass(frozen=True)
class Unread:
    """A restore target leaf that `read_tree` checks (its shape) but does not read; returned
    as it is, for its owner to read (`fsdp_jax.nvme` rebuilds its layer files from the files)."""

    shape: tuple[int, ...]
    dtype: Any


def _bounds(index: tuple, shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    start = tuple(0 if s.start is None else int(s.start) for s in index)
    stop = tuple(n if s.stop is None else int(s.stop) for s, n in zip(index, shape))
    return start, stop


def host_shards(tree) -> tuple[list[Piece], dict[str, dict]]:
    """(the distinct shards of this process, leaf metadata {path: {shape, dtype}}).
    Returns once every shard is a host numpy array (so `tree` may be donated next).
    Leaves that are not jax Arrays (numpy arrays, Python numbers) are written by process 0."""
    leaves = tree_paths(tree)
    mine = []
    for path, x in leaves.items():
        if isinstance(x, Streamed):
            mine.append((path, x, None))
            continue
        if isinstance(x, jax.Array) and jax.dtypes.issubdtype(x.dtype, jax.dtypes.extended):
            raise TypeError(f"{path}: arrays of dtype {x.dtype} (e.g. PRNG keys) are not saved as shard files")
        if isinstance(x, jax.Array):
            shards = [s for s in x.addressable_shards if s.replica_id == 0]
            for s in shards:  # start every copy before waiting on any
                s.data.copy_to_host_async()
            mine.append((path, x, shards))
        else:
            mine.append((path, np.asarray(x), None))
    pieces, meta = [], {}
    for n, (path, x, shards) in enumerate(mine):
        shape = tuple(x.shape)
        meta[path] = {"shape": list(shape), "dtype": np.dtype(x.dtype).name}
        if isinstance(x, Streamed):
            for j, (start, stop) in enumerate(x.bounds()):
                nbytes = int(np.prod([b - a for a, b in zip(start, stop)], dtype=np.int64)) * np.dtype(x.dtype).itemsize
                pieces.append(Piece(path, f"{n:05d}." + "_".join(map(str, start)), start, stop, _Pending(x, j, nbytes)))
            continue
        if shards is None:
            if jax.process_index() == 0:
                pieces.append(Piece(path, f"{n:05d}.full", (0,) * len(shape), shape, x))
            continue
        for s in shards:
            start, stop = _bounds(s.index, shape)
            name = f"{n:05d}." + ("_".join(map(str, start)) or "0")
            pieces.append(Piece(path, name, start, stop, s.data))
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        datas = list(pool.map(_host_copy, [p.data for p in pieces]))
    return [p._replace(data=d) for p, d in zip(pieces, datas)], meta


def write_streamed(directory: str | os.PathLike, pieces: list[Piece]) -> list[Piece]:
    """Have the owners of `Streamed` leaves write their shard files into `directory` (one
    `writer.write` call per writer, in this thread); returns `pieces` with those written."""
    by_writer: dict[int, tuple[Any, list]] = {}
    for p in pieces:
        if isinstance(p.data, _Pending):
            by_writer.setdefault(id(p.data.leaf.writer), (p.data.leaf.writer, []))[1].append(p)
    if not by_writer:
        return pieces
    Path(directory).mkdir(parents=True, exist_ok=True)
    done: dict[str, Written] = {}
    for writer, mine in by_writer.values():
        got = writer.write(Path(directory), [(p.data.leaf, p.data.shard, p.file) for p in mine])
        done.update({p.file: Written(*got[p.file], p.data.nbytes) for p in mine})
    return [p._replace(data=done[p.file]) if p.file in done else p for p in pieces]


def _host_copy(x):
    """`x` as a C-order host array (a `Streamed` leaf's shard: as it is). A buffer already in
    host memory (a CPU device's, or `pinned_host`) is viewed zero-copy, as Orbax does: the
    view holds a reference on the buffer, so the next step's donation of the state cannot
    reuse its memory under the background write (tests/test_shard_files.py checks the values
    survive it)."""
    if isinstance(x, _Pending):
        return x
    return np.ascontiguousarray(np.asarray(x))


def _write_file(path: Path, a: np.ndarray) -> tuple[str, int]:
    return direct_io.write_file(path, a)


def write_shards(directory: str | os.PathLike, pieces: list[Piece], meta: dict[str, dict]) -> dict:
    """Write `pieces` (from `host_shards`) into `directory` and this process's index;
    returns the index. OSError (disk full, ...) propagates."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    if any(isinstance(p.data, _Pending) for p in pieces):
        raise ValueError("write_shards: Streamed leaves are written by write_streamed first")
    written = {p.file: (p.data.crc32, p.data.pad) for p in pieces if isinstance(p.data, Written)}
    order = sorted((p for p in pieces if p.file not in written), key=lambda p: -p.data.nbytes)  # big first
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        crcs = dict(zip((p.file for p in order), pool.map(lambda p: _write_file(directory / p.file, p.data), order)))
    crcs.update(written)
    leaves = {path: dict(m, files=[]) for path, m in meta.items()}
    for p in pieces:
        crc, pad = crcs[p.file]
        leaves[p.path]["files"].append(
            {
                "file": p.file,
                "start": list(p.start),
                "stop": list(p.stop),
                "offset": pad,
                "bytes": pad + p.data.nbytes,
                "crc32": crc,
            }
        )
    index = {"format": "fsdp_jax.shard_files/1", "process": jax.process_index(), "leaves": leaves}
    out = directory / INDEX.format(jax.process_index())
    out.write_text(json.dumps(index))
    with open(out, "rb") as f:
        os.fsync(f.fileno())
    return index


def read_index(directory: str | os.PathLike) -> dict[str, dict]:
    """{leaf path: {shape, dtype, files: [...]}} over every process's index in `directory`."""
    leaves: dict[str, dict] = {}
    indexes = sorted(Path(directory).glob(SHARD_INDEX_GLOB))
    if not indexes:
        raise ShardFileError(f"{directory}: no {INDEX.format('<process>')} index")
    for f in indexes:
        for path, m in json.loads(f.read_text())["leaves"].items():
            leaf = leaves.setdefault(path, {"shape": m["shape"], "dtype": m["dtype"], "files": []})
            leaf["files"] += m["files"]
    return leaves


def is_shard_dir(directory: str | os.PathLike) -> bool:
    return any(Path(directory).glob(SHARD_INDEX_GLOB))


def metadata(directory) -> dict[str, jax.ShapeDtypeStruct]:
    """{leaf path: ShapeDtypeStruct(shape, dtype)} of the saved leaves."""
    return {p: jax.ShapeDtypeStruct(tuple(m["shape"]), np.dtype(m["dtype"])) for p, m in read_index(directory).items()}


def start_load(directory: Path, entry: dict, dtype, shape, pool: cf.Executor) -> Callable[[], np.ndarray]:
    """Start reading one shard file, its pieces (`direct_io.pieces`) as jobs on `pool`, each
    straight into the memory that becomes the array; returns the function that waits for
    them and gives the array of `shape` / `dtype`, its size and CRC-32 checked (else
    `ShardFileError`: missing, resized, short read, changed). Call it from outside `pool`."""
    rel = f"{directory.name}/{entry['file']}"
    path = directory / entry["file"]
    pad = entry.get("offset", 0)
    nbytes = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise ShardFileError(f"{rel} is missing") from None
    if size != entry["bytes"] or size != pad + nbytes:
        raise ShardFileError(f"{rel} has {size} bytes, {entry['bytes']} when saved")
    raw = direct_io.aligned_empty((size,), np.uint8)  # becomes the array: no copy
    parts = [pool.submit(direct_io.read_range, path, raw, lo, hi) for lo, hi in direct_io.pieces(size)]

    def result() -> np.ndarray:
        try:
            crc, got = direct_io.combine([p.result() for p in parts])
        except FileNotFoundError:
            raise ShardFileError(f"{rel} is missing") from None
        crc = crc if got == size else "short read"
        if crc != entry["crc32"]:
            raise ShardFileError(f"{rel} has changed since it was saved (CRC-32 {crc}, {entry['crc32']} when saved)")
        return raw[pad:].view(dtype).reshape(shape)

    return result


def load_file(directory: Path, entry: dict, dtype, shape) -> np.ndarray:
    """One shard file as an array of `shape` / `dtype`, its size and CRC-32 checked, its
    pieces read one after another."""
    with cf.ThreadPoolExecutor(1) as pool:
        return start_load(directory, entry, dtype, shape, pool)()


def region(start, stop, files, loaded, dtype) -> np.ndarray:
    """The block [start, stop) of a leaf assembled from its loaded files."""
    for e in files:
        if list(start) == e["start"] and list(stop) == e["stop"]:
            return loaded[e["file"]].astype(dtype, copy=False)
    out = np.empty([b - a for a, b in zip(start, stop)], dtype)
    for e in files:
        lo = [max(a, s) for a, s in zip(start, e["start"])]
        hi = [min(b, s) for b, s in zip(stop, e["stop"])]
        if all(a < b for a, b in zip(lo, hi)) or not lo:
            src = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, e["start"]))
            dst = tuple(slice(a - s, b - s) for a, b, s in zip(lo, hi, start))
            out[dst] = loaded[e["file"]][src]
    return out


def overlaps(files, start, stop) -> list[dict]:
    return [e for e in files if all(max(a, s) < min(b, t) for a, b, s, t in zip(start, stop, e["start"], e["stop"]))]


def _start_reads(directory: Path, m: dict, target: Any, pool: cf.Executor):
    """Submit the reads of the files `target`'s local shards overlap (every piece of every
    file a job on `pool`); returns what `_assemble` needs: {file: function giving its array}."""
    shape = tuple(m["shape"])
    sharding = getattr(target, "sharding", None)
    regions = (
        [_bounds(i, shape) for i in sharding.addressable_devices_indices_map(shape).values()]
        if sharding is not None
        else [((0,) * len(shape), shape)]
    )
    need = {e["file"]: e for r in regions for e in (overlaps(m["files"], *r) if shape else m["files"])}
    saved = np.dtype(m["dtype"])
    return {
        f: start_load(directory, e, saved, [b - a for a, b in zip(e["start"], e["stop"])], pool)
        for f, e in need.items()
    }


def _assemble(m: dict, target: Any, jobs: dict):
    """The leaf laid out as `target` (with a sharding: a jax Array, without: numpy) from
    its files' reads."""
    shape = tuple(m["shape"])
    dtype = np.dtype(getattr(target, "dtype", np.dtype(m["dtype"])))
    loaded = {f: j() for f, j in jobs.items()}
    sharding = getattr(target, "sharding", None)
    if sharding is None:
        return region((0,) * len(shape), shape, m["files"], loaded, dtype)
    return jax.make_array_from_callback(
        shape, sharding, lambda idx: region(*_bounds(idx, shape), m["files"], loaded, dtype)
    )


def read_tree(directory: str | os.PathLike, target):
    """`target` (a pytree of ShapeDtypeStructs with shardings) restored from the shard files
    in `directory`: every target leaf must be saved with the same shape (else ShardFileError).
    The next `AHEAD` leaves' files are read while one is assembled (so at most AHEAD + 1
    leaves' local shards wait in host memory). `Unread` target leaves come back as they are."""
    directory = Path(directory)
    leaves = read_index(directory)
    flat, treedef = jax.tree_util.tree_flatten(target)
    todo, unread = [], {}
    for k, (name, t) in enumerate(zip(tree_paths(target), flat)):
        m = leaves.get(name)
        if m is None or tuple(m["shape"]) != tuple(t.shape):
            got = "not saved" if m is None else f"saved {tuple(m['shape'])}"
            raise ShardFileError(f"{directory}: {name} {got}, wanted {tuple(t.shape)}")
        if isinstance(t, Unread):
            unread[k] = t
        else:
            todo.append((m, t))
    out = []
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        jobs = [_start_reads(directory, *x, pool) for x in todo[:AHEAD]]
        for k, (m, t) in enumerate(todo):
            if k + AHEAD < len(todo):
                jobs.append(_start_reads(directory, *todo[k + AHEAD], pool))
            out.append(_assemble(m, t, jobs[k]))
            jobs[k] = None  # its host copies go once the array exists
    for k, t in sorted(unread.items()):
        out.insert(k, t)
    return jax.tree_util.tree_unflatten(treedef, out)


def read_whole(directory: str | os.PathLike, path: str) -> np.ndarray:
    """One saved leaf, whole, as a host numpy array in its saved dtype."""
    m = read_index(directory).get(path)
    if m is None:
        raise KeyError(f"{directory}: no saved leaf {path!r}")
    with cf.ThreadPoolExecutor(WORKERS) as pool:
        return _assemble(m, None, _start_reads(Path(directory), m, None, pool))
