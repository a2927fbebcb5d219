"""Whole files written and read past the page cache (O_DIRECT), CRC-32 computed on the way.

    crc, pad = write_file(path, a)                 # a's bytes at offset pad, fsync'd; the file's CRC
    raw = aligned_empty((size,), np.uint8)         # page-aligned host memory
    crc2, got = read_file(path, raw)               # the file back; a's bytes are raw[pad:]

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

The checksum is zlib's CRC-32 (the value `zlib.crc32` gives, so checkpoints written before
are verified the same way), computed by zlib-ng's carry-less-multiply code: several times zlib's speed on one core, so
on a 2-core machine it no longer competes with the I/O (BENCHMARKS.md, checkpoint restore).
"""

from __future__ import annotations

import mmap
import os

import numpy as np

try:  # zlib-ng (a dependency): zlib's CRC-32, faster; the GIL released on large buffers
    from zlib_ng.zlib_ng import crc32 as _crc32
except ImportError:  # pragma: no cover - the same values, slower
    from zlib import crc32 as _crc32


def crc32(data, value: int = 0) -> int:
    """zlib's CRC-32 of `data` (a bytes-like buffer) continued from `value`."""
    return _crc32(data, value)


ALIGN = 4096  # bytes: the largest logical block size in common use
CHUNK = 64 << 20  # bytes per write / read call (a multiple of ALIGN)
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


def _open(path, flags: int) -> tuple[int, bool]:
    """(fd, whether it is O_DIRECT): O_DIRECT where the file system takes it."""
    if _DIRECT:
        try:
            return os.open(path, flags | _DIRECT, 0o644), True
        except OSError:  # EINVAL: tmpfs and friends
            pass
    return os.open(path, flags, 0o644), False


def _write_all(fd: int, view: memoryview, offset: int) -> None:
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
    fd, direct = _open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    pad = (np.frombuffer(buf, np.uint8).ctypes.data % ALIGN) if direct and len(buf) else 0
    head = min(len(buf), (ALIGN - pad) % ALIGN) if direct else 0
    end = head + (len(buf) - head) // ALIGN * ALIGN if direct else len(buf)  # the bulk: [head, end)
    crc = crc32(buf[:head], crc32(bytes(pad)))  # over the whole file: pad, then data
    try:
        for off in range(head, end, CHUNK):
            piece = buf[off : min(off + CHUNK, end)]
            crc = crc32(piece, crc)
            _write_all(fd, piece, pad + off)
        if direct:  # the pad and head, and the tail, through the page cache
            plain = os.open(path, os.O_WRONLY)
            try:
                _write_all(plain, memoryview(bytes(pad) + bytes(buf[:head])), 0)
                crc = crc32(buf[end:], crc)
                _write_all(plain, buf[end:], pad + end)
                os.fsync(plain)
            finally:
                os.close(plain)
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return f"{crc:08x}", pad


def read_file(path, a: np.ndarray) -> tuple[str, int]:
    """Read the file `path` into `a` (C-contiguous, its size the file's); returns (CRC-32 of
    the bytes read, how many were read). FileNotFoundError propagates."""
    buf = memoryview(a.reshape(-1).view(np.uint8))
    bulk = len(buf) // ALIGN * ALIGN
    if _aligned(buf):
        fd, direct = _open(path, os.O_RDONLY)
    else:
        fd, direct = os.open(path, os.O_RDONLY), False
    crc, got = 0, 0
    try:
        end = bulk if direct else len(buf)
        while got < end:
            n = os.preadv(fd, [buf[got : min(got + CHUNK, end)]], got)
            if not n:
                break
            crc = crc32(buf[got : got + n], crc)
            got += n
    finally:
        os.close(fd)
    if direct and got == bulk and bulk < len(buf):
        with open(path, "rb", buffering=0) as f:
            f.seek(bulk)
            n = f.readinto(buf[bulk:])
            crc = crc32(buf[bulk : bulk + n], crc)
            got += n
    return f"{crc:08x}", got
