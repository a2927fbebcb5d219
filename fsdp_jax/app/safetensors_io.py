"""Sliced safetensors reads and streamed safetensors writes, for any dtype.

`SafetensorsFile(path)` parses the header (8-byte little-endian length, JSON) and
reads a block of a tensor — a row range and, for 2-D tensors, a column range —
with `os.pread`, so only those rows' bytes enter host memory (never a memory map
that would keep the whole file's pages resident), converting to the requested
dtype in bounded chunks. The `safetensors` library itself validates each file
(`check_file`), but its numpy backend cannot slice bfloat16 tensors (safetensors
0.8: "data type 'bfloat16' not understood"), the dtype most Llama checkpoints ship.

`write_safetensors(path, entries, fetch)` writes a file from a list of (name,
shape, dtype) and a `fetch(name) -> np.ndarray` callback, one tensor in memory at a
time, into a temporary name renamed at the end.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import ml_dtypes
import numpy as np

DTYPES = {"F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
          "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8, "U64": np.uint64,
          "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
_CHUNK_BYTES = 64 << 20  # bound on the raw bytes read per pread when slicing columns


class SafetensorsError(ValueError):
    """A file that is not valid safetensors, or a tensor it does not hold."""


class SafetensorsFile:
    """Header of one .safetensors file and sliced reads of its tensors."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                if n <= 0 or 8 + n > size:
                    raise ValueError(f"header length {n} does not fit a {size}-byte file")
                header = json.loads(f.read(n))
        except FileNotFoundError:
            raise SafetensorsError(f"{self.path}: file not found") from None
        except (OSError, ValueError, UnicodeDecodeError) as e:
            raise SafetensorsError(f"{self.path}: not a valid safetensors file ({e})") from None
        self.metadata = header.pop("__metadata__", None) or {}
        self.base = 8 + n
        self.tensors: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
        for name, h in header.items():
            try:
                dt = np.dtype(DTYPES[h["dtype"]])
                shape = tuple(int(d) for d in h["shape"])
                b, e = (int(x) for x in h["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise SafetensorsError(f"{self.path}: tensor {name!r} has an invalid header "
                                       f"entry {h!r}") from None
            if e - b != math.prod(shape) * dt.itemsize or self.base + e > size:
                raise SafetensorsError(f"{self.path}: tensor {name!r} lies outside the file or "
                                       "has the wrong byte size")
            self.tensors[name] = (dt, shape, self.base + b)

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self.tensors[name][0]

    def read(self, name: str, rows: slice | None = None, cols: slice | None = None,
             dtype: np.dtype | None = None) -> np.ndarray:
        """tensor[rows, cols] (1-D tensors: tensor[rows]) as a new array of `dtype`
        (default: as stored). Slices are contiguous (step 1)."""
        dt, shape, off = self.tensors[name]
        out_dt = np.dtype(dtype) if dtype is not None else dt
        r0, r1, _ = (rows or slice(None)).indices(shape[0]) if shape else (0, 1, 1)
        row_elems = math.prod(shape[1:])
        c0, c1 = (0, row_elems) if len(shape) != 2 else (cols or slice(None)).indices(shape[1])[:2]
        out = np.empty((r1 - r0,) + ((c1 - c0,) if len(shape) == 2 else tuple(shape[1:])), out_dt)
        step = max(1, _CHUNK_BYTES // max(1, row_elems * dt.itemsize))
        with open(self.path, "rb") as f:
            fd = f.fileno()
            for a in range(r0, r1, step):
                b = min(r1, a + step)
                nbytes = (b - a) * row_elems * dt.itemsize
                raw = os.pread(fd, nbytes, off + a * row_elems * dt.itemsize)
                if len(raw) != nbytes:
                    raise SafetensorsError(f"{self.path}: tensor {name!r} is truncated")
                block = np.frombuffer(raw, dt).reshape((b - a,) + tuple(shape[1:]))
                out[a - r0:b - r0] = block[:, c0:c1] if len(shape) == 2 else block
        return out if shape else out.reshape(())


def check_file(path: str | os.PathLike) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype name)} as the `safetensors` library reads `path` (an
    independent check of files this project writes)."""
    from safetensors import safe_open

    out = {}
    with safe_open(str(path), framework="np") as f:
        for k in f.keys():
            s = f.get_slice(k)
            out[k] = (list(s.get_shape()), s.get_dtype())
    return out


def write_safetensors(path: str | os.PathLike, entries: Sequence[tuple[str, tuple[int, ...], np.dtype]],
                      fetch: Callable[[str], np.ndarray], metadata: dict[str, str] | None = None) -> int:
    """Write `entries` (name, shape, dtype) in this order, each from `fetch(name)`
    (cast to its dtype; its shape must match). Returns the file size in bytes."""
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, shape, dt in entries:
        n = math.prod(shape) * np.dtype(dt).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dt)], "shape": list(shape),
                        "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little") + head)
            for name, shape, dt in entries:
                arr = np.ascontiguousarray(np.asarray(fetch(name)).astype(dt, copy=False))
                if arr.shape != tuple(shape):
                    raise ValueError(f"{name}: got shape {arr.shape}, expected {tuple(shape)}")
                f.write(memoryview(arr.reshape(-1).view(np.uint8)))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size
