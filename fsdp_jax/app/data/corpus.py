"""Token corpora on disk: preparing them from text files, the standard library's
sources or nanoGPT-style bins (`prepare_text`, `prepare_stdlib`, `prepare_bin`).

A corpus directory holds `train.bin` and `val.bin` (flat token ids, nanoGPT style:
uint16, or uint32 when the vocabulary needs it) and `meta.json`. `meta.json` is
written last, so a directory with a meta.json whose sizes match is complete.

Reading one back (`load_meta`) and its resumable, per-process batches of random
windows (`make_dataset`, `eval_batches`) are `fsdp_jax.app.data.windows`; those
names are importable from here too.
"""

from __future__ import annotations

import json
import os
import shutil
import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np

from fsdp_jax.app.data.tables import is_datasets_dir, is_tabular, source_size
from fsdp_jax.app.data.tokenizer import encode_corpus, load_tokenizer, read_documents
from fsdp_jax.app.data.windows import (
    load_meta,
)
from fsdp_jax.app.data.writable import dir_problem
from fsdp_jax.errors import DataError, TokenizerError


def token_dtype(vocab_size: int) -> np.dtype:
    """uint16 when every id < vocab_size fits in it, else uint32."""
    return np.dtype(np.uint16 if vocab_size <= 2**16 else np.uint32)


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp.{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def commit(out: Path, tmp_files: dict[str, Path], meta: dict) -> dict:
    """Replace the bins, then write meta.json; a crash in between leaves no meta.json,
    so the directory reads as missing rather than complete."""
    (out / "meta.json").unlink(missing_ok=True)
    for name, tmp in tmp_files.items():
        os.replace(tmp, out / name)
    _atomic_write_text(out / "meta.json", json.dumps(meta, indent=2) + "\n")
    return meta


def check_out(out_dir: str | os.PathLike) -> Path:
    problem = dir_problem(out_dir)
    if problem:
        raise DataError(f"output directory {str(out_dir)!r} {problem}")
    return Path(out_dir)


def collect(sources: Sequence[str | os.PathLike], pattern: str, exclude: Sequence[str]) -> list[Path]:
    files: dict[Path, None] = {}
    for src in sources:
        p = Path(src)
        if p.is_file() or is_datasets_dir(p):  # a datasets directory is one source (a table)
            files[p.resolve()] = None
        elif p.is_dir():
            if not pattern or Path(pattern).is_absolute() or ".." in Path(pattern).parts:
                raise DataError(f"pattern {pattern!r}: must be a relative file glob, e.g. '*.txt'")
            for f in sorted(p.rglob(pattern)):
                rel = f.relative_to(p).parts
                if (
                    f.is_file()
                    and not any(s.startswith(".") or s in exclude for s in rel[:-1])
                    and not rel[-1].startswith(".")
                ):  # a file of a datasets directory met on the walk: the directory is the source
                    files[(f.parent if is_datasets_dir(f.parent) else f).resolve()] = None
        else:
            raise DataError(f"source {str(src)!r}: not found")
    return [f for f in files if source_size(f) > 0]


def _split_files(files: list[Path], val_fraction: float, seed: int) -> tuple[list[Path], list[Path]]:
    """(train, val): the files shuffled with `seed`; whole files from the end, about
    `val_fraction` of the bytes, are val (in the order they are written). One file: no val."""
    total = sum(source_size(f) for f in files)
    files = [files[i] for i in np.random.default_rng(seed).permutation(len(files))]
    val, val_bytes = [], 0
    while files[: -1 - len(val)] and val_bytes < val_fraction * total:  # whole files, from the end
        val.append(files[-1 - len(val)])
        val_bytes += source_size(val[-1])
    return files[: len(files) - len(val)], val[::-1]


def _write_corpus(
    files: list[Path], out_dir: str | os.PathLike, val_fraction: float, seed: int, meta_extra: dict, text_key="text"
) -> dict:
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction!r}: must be in (0, 1)")
    if not isinstance(seed, int) or seed < 0:
        raise DataError(f"seed {seed!r}: must be an integer >= 0")
    check_out(out_dir)
    total = sum(source_size(f) for f in files)
    if total == 0:
        raise DataError("empty corpus: no non-empty files found in the sources")
    dtype = token_dtype(256)
    train, val = _split_files(files, val_fraction, seed)
    split = "files" if val else "bytes"  # one file: its last val_fraction of bytes become val
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = {n: out / f".{n}.tmp.{os.getpid()}" for n in ("train.bin", "val.bin")}
    counts, top = {"train.bin": 0, "val.bin": 0}, -1
    try:
        for name, group in (("train.bin", train), ("val.bin", val)):
            with open(tmp[name], "wb") as fh:
                for f in group:
                    for chunk in _file_bytes(f, text_key=text_key):  # a stream: no file is read whole
                        arr = np.frombuffer(chunk, np.uint8).astype(dtype)
                        top = max(top, int(arr.max())) if len(arr) else top
                        arr.tofile(fh)
                        counts[name] += len(arr)
        if split == "bytes" and counts["train.bin"]:  # one file: its last val_fraction of bytes become val
            n = counts["train.bin"]
            cut = n - max(1, int(round(val_fraction * n)))
            _move_tail(tmp["train.bin"], tmp["val.bin"], cut, dtype)
            counts = {"train.bin": cut, "val.bin": n - cut}
        if min(counts.values()) == 0:
            raise DataError(f"corpus of {total} bytes is too small to split with val_fraction {val_fraction}")
        meta = {
            "vocab_size": 256,
            "dtype": dtype.name,
            "tokenizer": "bytes",
            "max_token_id": top,
            "train_tokens": counts["train.bin"],
            "val_tokens": counts["val.bin"],
            **meta_extra,
            "val_fraction": val_fraction,
            "seed": seed,
            "split": split,
            "train_files": len(train),
            "val_files": len(val),
        }
        return commit(out, tmp, meta)
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # bad input: leave no trace


def _file_bytes(f: Path, chunk: int = 1 << 22, text_key: str = "text") -> Iterator[bytes]:
    """The byte tokenizer's text of a file, `chunk` bytes at a time: its bytes, or for a
    .jsonl file each line's {"text": ...} (a table: each row's) as UTF-8 followed by a
    newline (parsed exactly as with a real tokenizer; `text_key`: the key to read)."""
    if not is_tabular(f):
        with open(f, "rb") as fh:
            while block := fh.read(chunk):
                yield block
        return

    try:
        parts, size = [], 0
        for doc in read_documents(f, text_key):
            parts.append(doc.encode("utf-8", errors="replace") + b"\n")
            size += len(parts[-1])
            if size >= chunk:
                yield b"".join(parts)
                parts, size = [], 0
        yield b"".join(parts)
    except TokenizerError as e:
        raise DataError(str(e)) from None


def prepare_text(
    sources: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    val_fraction: float = 0.05,
    seed: int = 0,
    tokenizer: str = "bytes",
    pattern: str = "*",
    exclude: Sequence[str] = (),
    text_key: str = "text",
    **tokenize,
) -> dict:
    """Tokenize text files and directories (searched recursively for `pattern`, skipping
    hidden entries and directories named in `exclude`) into `out_dir`; returns meta.

    The split is by file: the file list is shuffled with `seed` and whole files from its
    end, about `val_fraction` of the bytes, become val.bin, so validation text is unseen.
    A single file is split by bytes instead (meta "split": "bytes"). Any bytes are
    accepted; the byte tokenizer needs no UTF-8. A .jsonl file is parsed whatever the
    tokenizer: one {"text": ...} document per line (bytes: its UTF-8 and a newline); so is a
    table (a .parquet file or a `datasets` directory, `fsdp_jax.app.data.tables`), a row a
    document. `text_key` names the key (column) holding the text.

    `tokenizer`: "bytes", or the path of a Hugging Face tokenizer.json, a SentencePiece
    .model or a model directory holding one (`fsdp_jax.app.data.tokenizer`); then each file
    (each line of a .jsonl file) is a document, `encode(doc) + [eos]`, and `tokenize`
    takes `eos` (token name), `threads` and `progress`.
    """
    files = collect(sources, pattern, exclude)
    extra = {"sources": [str(s) for s in sources], "pattern": pattern}
    if tokenizer != "bytes":
        return _write_tokenized(files, out_dir, val_fraction, seed, tokenizer, extra, text_key=text_key, **tokenize)
    return _write_corpus(files, out_dir, val_fraction, seed, extra, text_key)


def _write_tokenized(
    files: list[Path],
    out_dir: str | os.PathLike,
    val_fraction: float,
    seed: int,
    tokenizer: str,
    meta_extra: dict,
    eos: str | None = None,
    threads: int | None = None,
    progress: bool = False,
    text_key: str = "text",
) -> dict:
    """As `_write_corpus`, with a real tokenizer: every document becomes
    `encode(doc) + [eos]`; the split is the same (whole files; one file: its last
    val_fraction of tokens). Token dtype from the tokenizer's vocab size."""

    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction!r}: must be in (0, 1)")
    if not files:
        raise DataError("empty corpus: no non-empty files found in the sources")
    try:
        tok = load_tokenizer(tokenizer, eos)
    except TokenizerError as e:
        raise DataError(str(e)) from None
    dtype = token_dtype(tok.vocab_size)
    train, val = _split_files(files, val_fraction, seed)
    out = Path(out_dir)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = {n: out / f".{n}.tmp.{os.getpid()}" for n in ("train.bin", "val.bin")}
    counts, docs, top = {}, 0, [-1]
    try:
        for name, group in (("train.bin", train), ("val.bin", val)):
            with open(tmp[name], "wb") as fh:

                def write(ids, fh=fh):
                    top[0] = max(top[0], int(ids.max())) if len(ids) else top[0]
                    ids.astype(dtype).tofile(fh)

                try:
                    d, counts[name] = encode_corpus(tok, group, write, threads, progress, text_key)
                except TokenizerError as e:
                    raise DataError(str(e)) from None
                docs += d
        split = "files" if val else "tokens"
        if not val:  # one file: its last val_fraction of tokens become val
            n = counts["train.bin"]
            cut = n - max(1, int(round(val_fraction * n)))
            _move_tail(tmp["train.bin"], tmp["val.bin"], cut, dtype)
            counts = {"train.bin": cut, "val.bin": n - cut}
        if min(counts.values()) == 0:
            raise DataError(
                f"corpus of {sum(counts.values())} tokens is too small to split with val_fraction {val_fraction}"
            )
        meta = {
            "vocab_size": tok.vocab_size,
            "dtype": dtype.name,
            "tokenizer": tok.path,
            "tokenizer_kind": tok.kind,
            "eos_id": tok.eos_id,
            "max_token_id": top[0],
            "train_tokens": counts["train.bin"],
            "val_tokens": counts["val.bin"],
            "documents": docs,
            **meta_extra,
            "val_fraction": val_fraction,
            "seed": seed,
            "split": split,
            "train_files": len(train),
            "val_files": len(val),
        }
        return commit(out, tmp, meta)
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # bad input: leave no trace


def _move_tail(src: Path, dst: Path, cut: int, dtype: np.dtype, chunk: int = 1 << 22) -> None:
    """Tokens [cut:] of `src` become `dst` and `src` is truncated to [:cut], a chunk at a
    time (memory bounded, whatever the corpus size)."""
    tokens = np.memmap(src, dtype, "r")
    with open(dst, "wb") as fh:
        for i in range(cut, len(tokens), chunk):
            np.asarray(tokens[i : i + chunk]).tofile(fh)
    del tokens
    os.truncate(src, cut * dtype.itemsize)


def prepare_stdlib(
    out_dir: str | os.PathLike, val_fraction: float = 0.05, seed: int = 0, tokenizer: str = "bytes", **tokenize
) -> dict:
    """The default corpus: the top-level modules of this Python's stdlib (~4.7 MB of bytes);
    `tokenizer` and `tokenize` as in `prepare_text`."""
    root = Path(sysconfig.get_paths()["stdlib"])
    files = [f for f in sorted(root.glob("*.py")) if f.stat().st_size > 0]
    extra = {"sources": [str(root / "*.py")], "pattern": "*.py"}
    if tokenizer != "bytes":
        return _write_tokenized(files, out_dir, val_fraction, seed, tokenizer, extra, **tokenize)
    return _write_corpus(files, out_dir, val_fraction, seed, extra)


def ensure_stdlib(out_dir: str | os.PathLike) -> dict:
    """Meta of the stdlib corpus at `out_dir`, preparing it first when missing or incomplete."""
    try:
        return load_meta(out_dir)
    except DataError:
        return prepare_stdlib(out_dir)


def prepare_bin(
    train_bin: str | os.PathLike,
    val_bin: str | os.PathLike,
    out_dir: str | os.PathLike,
    vocab_size: int,
    dtype: str | None = None,
    check_tokens: bool = True,
) -> dict:
    """Adopt token files from any tokenizer: hard-link (or copy) them into `out_dir` as
    train.bin / val.bin and write meta.json. `dtype` defaults to token_dtype(vocab_size)."""
    if vocab_size <= 0:
        raise DataError(f"vocab_size {vocab_size}: must be > 0")
    if dtype not in (None, "uint16", "uint32"):
        raise DataError(f"dtype {dtype!r}: allowed uint16, uint32")
    dt = token_dtype(vocab_size) if dtype is None else np.dtype(dtype)
    if vocab_size > np.iinfo(dt).max + 1:
        raise DataError(f"vocab_size {vocab_size} does not fit dtype {dt.name}; use uint32")
    out = check_out(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tmp, counts, tops = {}, {}, []
    try:
        for name, src in (("train.bin", Path(train_bin)), ("val.bin", Path(val_bin))):
            if not src.is_file():
                raise DataError(f"token file {str(src)!r}: not found")
            size = src.stat().st_size
            if size == 0 or size % dt.itemsize:
                raise DataError(
                    f"token file {str(src)!r}: {size} bytes is not a non-empty whole number of {dt.name} tokens"
                )
            counts[name] = size // dt.itemsize
            if check_tokens:
                top = _max_token(np.memmap(src, dtype=dt, mode="r"))
                tops.append(top)
                if top >= vocab_size:
                    raise DataError(
                        f"token file {str(src)!r}: token id {top} >= vocab_size "
                        f"{vocab_size} (wrong --dtype or --vocab-size?)"
                    )
            dst = out / name
            if dst.exists() and dst.samefile(src):
                continue
            tmp[name] = out / f".{name}.tmp.{os.getpid()}"
            try:
                os.link(src, tmp[name])
            except OSError:
                shutil.copyfile(src, tmp[name])
        meta = {
            "vocab_size": vocab_size,
            "dtype": dt.name,
            "tokenizer": "external",
            **({"max_token_id": max(tops)} if len(tops) == 2 else {}),
            "train_tokens": counts["train.bin"],
            "val_tokens": counts["val.bin"],
            "sources": [str(train_bin), str(val_bin)],
        }
        return commit(out, tmp, meta)
    finally:
        for t in tmp.values():
            t.unlink(missing_ok=True)


def _max_token(tokens: np.ndarray, chunk: int = 1 << 24) -> int:
    return max(int(tokens[i : i + chunk].max()) for i in range(0, len(tokens), chunk))
