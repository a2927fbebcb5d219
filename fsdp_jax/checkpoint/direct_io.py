"""Whole files written and read past the page cache (O_DIRECT), CRC-32 computed on the way.

    crc, pad = write_file(path, a)                 # a's bytes at offset pad, fsync'd; the file's CRC
    raw = aligned_empty((size,), np.uint8)         # page-aligned host memory
    crc2, got = read_file(path, raw)               # the file back; a's bytes are raw[pad:]
    parts = [pool.submit(read_range, path, raw, lo, hi) for lo, hi in pieces(size)]
    crc3, got = combine([p.result() for p in parts])   # the same, its pieces read in parallel

O_DIRECT moves the bytes between the buffer and the disk with no copy into the page
cache, as `dd oflag=direct` does: on a busy machine the copy into the cache (and its
writeback) is what held buffered writes to a third of the disk's speed. It needs the
buffer's address, the file offset and the length aligned to the device's block. Arrays are
not page-aligned (XLA:CPU's sit 64 bytes past a page), so a file starts with `pad` bytes
(the array's distance past an aligned address) before the data: then the bulk is aligned
in memory and in the file at once and goes direct, with no copy; the few bytes before and
after it go through an ordinary descriptor. A file system without O_DIRECT (tmpfs) gets
ordinary writes and reads, then the written pages dropped from the cache
(`POSIX_FADV_DONTNEED`).

A file is read in pieces (`pieces`: PIECE bytes of the aligned bulk each, then the tail), each
read straight into its place in the destination buffer and checksummed on its own; `combine`
joins the pieces' CRC-32s into the file's (zlib's `crc32_combine`). So the pieces of one large
file can be read by several threads at once, each piece's CRC computed while the others' reads
are in flight (BENCHMARKS.md, checkpoint restore: one thread reading a large file alternates
between the disk and the CPU).

The checksum is zlib's CRC-32 (the value `zlib.crc32` gives, so checkpoints written before
are verified the same way), computed by zlib-ng's carry-less-multiply code: several times zlib's speed on one core, so
on a 2-core machine it no longer competes with the I/O (BENCHMARKS.md, checkpoint restore).
"""

from __future__ import annotations

import mmap
import os

import numpy as np


def _combine_over_zeros(crc1: int, crc2: int, len2: int) -> int:
    """`crc32_combine` from `crc32` alone (slower: it checksums len2 zero bytes twice). The
    CRC is affine in the data: continuing crc1 over len2 zero bytes and adding crc2 less the
    zeros' own CRC gives crc32(A + B)."""
    zeros = bytes(len2)
    return _crc32(zeros, crc1) ^ _crc32(zeros) ^ crc2


try:  # zlib-ng (a dependency): zlib's CRC-32, faster; the GIL released on large buffers
    from zlib_ng.zlib_ng import crc32 as _crc32
    from zlib_ng.zlib_ng import crc32_combine as _crc32_combine
except ImportError:  # pragma: no cover - the same values, slower
    from zlib import crc32 as _crc32

    _crc32_combine = _combine_over_zeros


def crc32(data, value: int = 0) -> int:
    """zlib's CRC-32 of `data` (a bytes-like buffer) continued from `value`."""
    return _crc32(data, value)


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """The CRC-32 of A + B from crc32(A), crc32(B) and len(B) (zlib's `crc32_combine`)."""
    return _crc32_combine(crc1, crc2, len2)


ALIGN = 4096  # bytes: the largest logical block size in common use
CHUNK = 64 << 20  # bytes per write / read call (a multiple of ALIGN)
PIECE = 64 << 20  # bytes of a file read as one piece (`pieces`; a multiple of ALIGN)
_DIRECT = getattr(os, "O_DIRECT", 0)


def aligned_empty(shape, dtype) -> np.ndarray:
    """An uninitialised C-order array in page-aligned memory: a private anonymous mmap, whose
    pages the kernel faults in as they are first written (by `read_file`'s O_DIRECT reads).
    Private, not shared: a shared anonymous mapping is shmem, each page of it a page-cache
    page of a hidden file, and faulting those in took a restore's reader threads as long as
    the reads (BENCHMARKS.md, checkpoint restore)."""
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    private = getattr(mmap, "MAP_PRIVATE", 0) | getattr(mmap, "MAP_ANONYMOUS", 0)
    m = mmap.mmap(-1, max(n, 1), flags=private) if private else mmap.mmap(-1, max(n, 1))
    return np.frombuffer(m, np.uint8, n).view(dtype).reshape(shape)


def _aligned(buf: memoryview) -> bool:
    return np.frombuffer(buf, np.uint8).ctypes.data % ALIGN == 0 if len(buf) else True


def open_direct(path, flags: int) -> tuple[int, bool]:
    """(fd, whether it is O_DIRECT): O_DIRECT where the file system takes it."""
    if _DIRECT:
        try:
            return os.open(path, flags | _DIRECT, 0o644), True
        except OSError:  # EINVAL: tmpfs and friends
            pass
    return os.open(path, flags, 0o644), False


def write_all(fd: int, view: memoryview, offset: int) -> None:
    done = 0
    while done < len(view):
        done += os.pwrite(fd, view[done:], offset + done)


def write_file(path, a: np.ndarray) -> tuple[str, int]:
    """Write `a`'s bytes (C order) into the file `path` at offset `pad`, fsync it; returns
    (CRC-32 of the file's bytes, pad included, as 8 hex digits; `pad`). `pad` (< ALIGN) is the buffer's
    distance past an aligned address, so that the file offset and the memory address of
    the bulk are aligned together and it goes direct with no copy; the `pad` bytes before
    the data, the head up to the first aligned address and the tail go through an ordinary
    descriptor. Without O_DIRECT: `pad` 0, ordinary writes. OSError propagates."""
    buf = memoryview(np.ascontiguousarray(a).reshape(-1).view(np.uint8))
    fd, direct = open_direct(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    pad = (np.frombuffer(buf, np.uint8).ctypes.data % ALIGN) if direct and len(buf) else 0
    head = min(len(buf), (ALIGN - pad) % ALIGN) if direct else 0
    end = head + (len(buf) - head) // ALIGN * ALIGN if direct else len(buf)  # the bulk: [head, end)
    crc = crc32(buf[:head], crc32(bytes(pad)))  # over the whole file: pad, then data
    try:
        for off in range(head, end, CHUNK):
            piece = buf[off : min(off + CHUNK, end)]
            crc = crc32(piece, crc)
            write_all(fd, piece, pad + off)
        if direct:  # the pad and head, and the tail, through the page cache
            plain = os.open(path, os.O_WRONLY)
            try:
                write_all(plain, memoryview(bytes(pad) + bytes(buf[:head])), 0)
                crc = crc32(buf[end:], crc)
                write_all(plain, buf[end:], pad + end)
                os.fsync(plain)
            finally:
                os.close(plain)
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return f"{crc:08x}", pad


def pieces(nbytes: int) -> list[tuple[int, int]]:
    """[start, stop) byte ranges that cover a file of `nbytes` in order: PIECE bytes at a
    time over the aligned bulk (each range aligned at both ends, so it can go direct), then
    the tail past the last aligned offset (under ALIGN bytes; read through the page cache)."""
    bulk = nbytes // ALIGN * ALIGN
    out = [(lo, min(lo + PIECE, bulk)) for lo in range(0, bulk, PIECE)]
    return out + ([(bulk, nbytes)] if bulk < nbytes else [])


def read_range(path, a: np.ndarray, start: int, stop: int) -> tuple[int, int, int]:
    """Read bytes [start, stop) of the file `path` into the same bytes of `a` (C-contiguous);
    returns (CRC-32 of the bytes read, how many were read, stop - start). Past the page cache
    (O_DIRECT) when the range and its place in `a` are aligned and the file system allows,
    else through an ordinary descriptor. A file shorter than `stop` reads short (the count
    says so). FileNotFoundError propagates."""
    view = memoryview(a.reshape(-1).view(np.uint8))[start:stop]
    if start % ALIGN == 0 and len(view) % ALIGN == 0 and _aligned(view):
        fd, direct = open_direct(path, os.O_RDONLY)
    else:
        fd, direct = os.open(path, os.O_RDONLY), False
    crc, got = 0, 0
    try:
        while got < len(view):
            n = os.preadv(fd, [view[got : min(got + CHUNK, len(view))]], start + got)
            crc = crc32(view[got : got + n], crc)
            got += n
            if not n or (direct and got % ALIGN):  # the end of the file (no further aligned offset to read at)
                break
    finally:
        os.close(fd)
    return crc, got, len(view)


def combine(parts) -> tuple[str, int]:
    """(the file's CRC-32 as 8 hex digits, bytes read) from its pieces' `read_range` results,
    in file order."""
    crc, got = 0, 0
    for c, n, _ in parts:
        crc, got = crc32_combine(crc, c, n), got + n
    return f"{crc:08x}", got


def read_file(path, a: np.ndarray) -> tuple[str, int]:
    """Read the file `path` into `a` (C-contiguous, its size the file's), its pieces one
    after another; returns (CRC-32 of the bytes read, how many were read).
    FileNotFoundError propagates."""
    nbytes = a.size * a.itemsize
    return combine(read_range(path, a, lo, hi) for lo, hi in pieces(nbytes))
