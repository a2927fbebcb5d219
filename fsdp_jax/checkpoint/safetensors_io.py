"""The safetensors format: checked headers, sliced reads, streamed writes, any dtype.

One implementation for the library (checkpoint export / `load_safetensors` /
`init_from`) and the application (Hugging Face import and export, `convert`).

A file is an 8-byte little-endian header length, a JSON object
`{name: {"dtype", "shape", "data_offsets": [begin, end]}, "__metadata__": {...}}`
and the tensors' bytes (row-major, little-endian), offsets counted from the end of
the header.

`SafetensorsFile(path)` checks the whole header against the file before anything
is read (the length before reading that much, every entry's dtype, shape and byte
range), so a hostile file is one `SafetensorsError` line naming it. `read` takes a
block of a tensor — a slice per leading dimension — with `os.pread`, so only the
rows of that block enter host memory (no memory map keeping the file's pages
resident), converting to the requested dtype in bounded chunks. The `safetensors`
library itself validates files this project writes (`check_file`), but its numpy
backend cannot slice bfloat16 tensors (safetensors 0.8: "data type 'bfloat16' not
understood"), the dtype most Llama checkpoints ship, and its writer needs every
tensor in memory at once.

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
from safetensors import safe_open

from fsdp_jax.errors import SafetensorsError, one_line

DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn,  # DeepSeek-V3's published weights (`app.hf.fp8_blocks`)
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
NAMES = {np.dtype(v): k for k, v in DTYPES.items()}
MAX_HEADER = 100 << 20  # bytes; as the safetensors format itself limits it
_CHUNK_BYTES = 64 << 20  # bound on the raw bytes read per pread


def _int_list(v) -> bool:
    return isinstance(v, list) and all(isinstance(x, int) and not isinstance(x, bool) and x >= 0 for x in v)


class SafetensorsFile:
    """Header of one .safetensors file and sliced reads of its tensors.

    `tensors`: {name: (dtype, shape, absolute byte offset)}; `metadata`: the
    `__metadata__` strings."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        try:
            size = self.path.stat().st_size
            with open(self.path, "rb") as f:
                n = int.from_bytes(f.read(8), "little")
                # The header length comes from the file: check it before reading that much.
                if size < 8 or not 2 <= n <= min(size - 8, MAX_HEADER):
                    raise ValueError(f"header length {n} does not fit a file of {size} bytes")
                header = json.loads(f.read(n))
            if not isinstance(header, dict):
                raise ValueError("the header is not a JSON object")
            self.metadata = header.pop("__metadata__", None) or {}
            self.base = 8 + n
            self.tensors: dict[str, tuple[np.dtype, tuple[int, ...], int]] = {}
            spans: list[tuple[int, int, str]] = []
            for name, h in header.items():
                if not (
                    isinstance(h, dict)
                    and h.get("dtype") in DTYPES
                    and _int_list(h.get("shape"))
                    and _int_list(h.get("data_offsets"))
                    and len(h["data_offsets"]) == 2
                ):
                    raise ValueError(f"tensor {name!r}: bad header entry {str(h)[:80]}")
                b, e = h["data_offsets"]
                dt = np.dtype(DTYPES[h["dtype"]])
                if not b <= e or self.base + e > size or e - b != math.prod(h["shape"]) * dt.itemsize:
                    raise ValueError(f"tensor {name!r} lies outside the file or has the wrong size")
                self.tensors[name] = (dt, tuple(h["shape"]), self.base + b)
                spans.append((b, e, name))
            # tensors may not share bytes (the format's own reader refuses that too): an
            # overlap would hand one tensor another's values
            spans.sort()
            for (_, e0, n0), (b1, e1, n1) in zip(spans, spans[1:]):
                if b1 < e0 and b1 < e1:
                    raise ValueError(f"tensors {n0!r} and {n1!r} overlap in the file")
        except FileNotFoundError:
            raise SafetensorsError(f"{self.path}: safetensors file not found") from None
        except (OSError, ValueError, KeyError, TypeError, RecursionError) as e:
            raise SafetensorsError(f"{self.path}: not a valid safetensors file ({one_line(e)})") from None

    def shape(self, name: str) -> tuple[int, ...]:
        return self.tensors[name][1]

    def dtype(self, name: str) -> np.dtype:
        return self.tensors[name][0]

    def read(self, name: str, *index: slice | None, dtype: np.dtype | None = None) -> np.ndarray:
        """tensor[index] as a new array of `dtype` (default: as stored). `index` holds a
        contiguous slice (or None: all) per leading dimension, e.g. (rows, cols); the
        rows are read in chunks of at most 64 MiB of raw bytes, the other dimensions
        are sliced in memory."""
        if name not in self.tensors:
            raise SafetensorsError(f"{self.path}: no tensor {name!r}")
        dt, shape, off = self.tensors[name]
        if len(index) > max(1, len(shape)):
            raise IndexError(f"{name}: {len(index)} slices for a {len(shape)}-D tensor")
        out_dt = np.dtype(dtype) if dtype is not None else dt
        rows = index[0] if index else None
        rest = tuple(s if s is not None else slice(None) for s in index[1:])
        r0, r1, _ = (rows or slice(None)).indices(shape[0]) if shape else (0, 1, 1)
        row_shape = tuple(shape[1:])
        row_bytes = math.prod(row_shape) * dt.itemsize
        out_row = tuple(len(range(*s.indices(d))) for s, d in zip(rest, row_shape)) + row_shape[len(rest) :]
        out = np.empty((r1 - r0,) + out_row, out_dt)
        step = max(1, _CHUNK_BYTES // max(1, row_bytes))
        with open(self.path, "rb") as f:
            fd = f.fileno()
            for a in range(r0, r1, step):
                b = min(r1, a + step)
                raw = os.pread(fd, (b - a) * row_bytes, off + a * row_bytes)
                if len(raw) != (b - a) * row_bytes:
                    raise SafetensorsError(f"{self.path}: tensor {name!r} is truncated")
                block = np.frombuffer(raw, dt).reshape((b - a,) + row_shape)
                out[a - r0 : b - r0] = block[(slice(None),) + rest]
        return out if shape else out.reshape(())


def check_file(path: str | os.PathLike) -> dict[str, tuple[list[int], str]]:
    """{name: (shape, dtype name)} as the `safetensors` library reads `path` (an
    independent check of files this project writes)."""

    out = {}
    with safe_open(str(path), framework="np") as f:
        for k in f.keys():
            s = f.get_slice(k)
            out[k] = (list(s.get_shape()), s.get_dtype())
    return out


def write_safetensors(
    path: str | os.PathLike,
    entries: Sequence[tuple[str, tuple[int, ...], np.dtype]],
    fetch: Callable[[str], np.ndarray],
    metadata: dict[str, str] | None = None,
) -> int:
    """Write `entries` (name, shape, dtype) in this order, each from `fetch(name)`
    (cast to its dtype; its shape must match). Returns the file size in bytes."""
    header: dict = {"__metadata__": dict(metadata or {})}
    offset = 0
    for name, shape, dt in entries:
        n = math.prod(shape) * np.dtype(dt).itemsize
        header[name] = {"dtype": NAMES[np.dtype(dt)], "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            f.write(len(head).to_bytes(8, "little") + head)
            for name, shape, dt in entries:
                arr = np.asarray(fetch(name)).astype(dt, copy=False)
                if arr.shape != tuple(shape):
                    raise ValueError(f"{name}: got shape {arr.shape}, expected {tuple(shape)}")
                # ascontiguousarray makes 0-d arrays 1-d: check the shape first
                f.write(memoryview(np.ascontiguousarray(arr).reshape(-1).view(np.uint8)))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path.stat().st_size
