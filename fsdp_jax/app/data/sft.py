"""Packed fine-tuning corpora, prepared as a stream.

    meta = prepare_examples(["chats.jsonl"], "data/sft", row_len=512, tokenizer="ckpt/")

A packed corpus directory holds, per split (train, val), `<split>.bin` (tokens, rows x
row_len, uint16/uint32), `<split>.mask.bin` (uint8: 1 where the token is a training
target) and `<split>.seg.bin` (the example's number in its row, 0 = padding: uint16, uint32 for rows
of 65536 tokens or more; meta.json's `seg_dtype`, uint16 when absent),
`chat_template.jinja` (the template its chats were rendered with, when there was one:
`export --hf` ships it with the model) and `meta.json` (`"format": "packed"`, `row_len`,
counts, the packing report and `max_token_id`), written last.

Preparing is a stream: records are read line by line, encoded in batches of about
`BATCH_BYTES` of text (the tokenizer's own threads), packed a buffer at a time (best-fit
decreasing, `fsdp_jax.app.data.packing`) and appended to temporary files, one split each
(`fsdp_jax.app.data.packed_splits`); memory is bounded by the buffer, not the corpus. A text file over `tokenizer.LONG_BYTES` is one plain
example read and encoded in windows (`fsdp_jax.app.data.tokenizer.encode_long`), its pieces
packed as they come. `workers` > 1 encodes batches in worker processes
(`fsdp_jax.app.data.encode_pool`), in order: the same corpus as one worker. The split is by
example: example i (counted over the sources in order) is held out for val when a hash
of (seed, i) falls below `val_fraction`, so val examples are never trained on. Only when everything is written
are the files renamed into place and meta.json written; a kill leaves the previous
corpus (or none) and temporary files that the next run removes.

Reading a packed corpus back as resumable batches is `fsdp_jax.app.data.packed_rows`
(`make_packed_dataset`, `packed_eval_batches`, `row_indices`); those names are
importable from here too.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fsdp_jax.app.data.corpus import check_out, collect, commit, token_dtype
from fsdp_jax.app.data.encode_pool import encode_batches
from fsdp_jax.app.data.encode_worker import EncoderSpec
from fsdp_jax.app.data.examples import ExampleEncoder, find_chat_template, read_records, special_tokens
from fsdp_jax.app.data.packed_splits import PackedSplits
from fsdp_jax.app.data.packing import MAX_ROW_LEN, PackStats, seg_dtype
from fsdp_jax.app.data.tables import KeyMap, source_size
from fsdp_jax.app.data.tokenizer import encode_long, is_long, load_tokenizer, text_chunks
from fsdp_jax.errors import DataError, ExampleError, TokenizerError

BATCH_BYTES = 1 << 20  # text per encode call (its Python token lists dominate memory)
PACK_TOKENS = 1 << 21  # tokens buffered before a pack (and at least 256 rows' worth)


def _text_size(rec) -> int:
    """Characters of text in a record (what an encode batch is sized by)."""
    if isinstance(rec, str):
        return len(rec)
    if isinstance(rec, dict):
        return sum(_text_size(v) for v in rec.values())
    if isinstance(rec, list):
        return sum(_text_size(v) for v in rec)
    return 8


def _remove_stale(out: Path) -> None:
    """Temporary files of earlier runs whose process is gone (a killed prepare)."""
    for f in out.glob(".*.tmp.*"):
        try:
            pid = int(f.name.rsplit(".", 1)[1])
            os.kill(pid, 0)
        except (ValueError, ProcessLookupError):
            f.unlink(missing_ok=True)
        except PermissionError:
            pass


def _long_tokens(file: Path, tok):
    """A long text file's tokens as a stream (`fsdp_jax.app.data.tokenizer.encode_long`), as
    `ExampleEncoder` would encode it whole: UTF-8 bytes, or encode(text) + [eos]."""
    if tok is None:
        for text in text_chunks(file):
            yield np.frombuffer(text.encode("utf-8", errors="replace"), np.uint8).astype(np.int32)
        return
    yield from encode_long(tok, text_chunks(file))
    yield np.asarray([tok.eos_id], np.int32)


def _check_options(val_fraction, row_len, threads, workers, overflow) -> None:
    """`prepare_examples`' numeric and named options, before anything is read."""
    if not 0 < val_fraction < 1:
        raise DataError(f"val_fraction {val_fraction!r}: must be in (0, 1)")
    if not isinstance(row_len, int) or not 2 <= row_len <= MAX_ROW_LEN:
        raise DataError(f"row length {row_len!r}: must be in 2..{MAX_ROW_LEN}")
    if threads is not None and threads < 1:
        raise DataError(f"threads {threads}: must be >= 1")
    if not isinstance(workers, int) or workers < 1:
        raise DataError(f"workers {workers!r}: must be an integer >= 1")
    if overflow not in ("truncate", "split"):
        raise DataError(f"overflow {overflow!r}: allowed truncate, split")


def _encoder(tokenizer: str, eos, chat_template, train_on: str, threads):
    """(tokenizer or None for bytes, the workers' EncoderSpec, this process's ExampleEncoder),
    checked here and now; DataError on a bad tokenizer or template."""

    try:
        tok = None if tokenizer == "bytes" else load_tokenizer(tokenizer, eos)
        template = (
            Path(chat_template).read_text() if chat_template else None if tok is None else find_chat_template(tokenizer)
        )
        spec = EncoderSpec(
            tokenizer, eos, template, {} if tok is None else special_tokens(tokenizer), train_on, threads
        )
        enc = ExampleEncoder(tok, template, spec.specials, train_on)  # checks them, here and now
    except (TokenizerError, ExampleError) as e:
        raise DataError(str(e)) from None
    except OSError as e:
        raise DataError(f"chat template {chat_template!r}: {e.strerror or e}") from None
    return tok, spec, enc


def _text_batches(files, bar, keys: KeyMap = KeyMap()):
    """(record, "file:line") lists of about BATCH_BYTES of text, in order; a long text
    file is yielded as its path (one plain example, streamed by this process)."""
    batch, size = [], 0
    for f in files:
        if is_long(f):  # one plain example, streamed by this process
            if batch:
                yield batch
            batch, size = [], 0
            yield f
            bar.update(source_size(f))
            continue
        for n, rec in read_records(f, keys):
            batch.append((rec, f"{f}:{n}"))
            size += _text_size(rec)
            if size >= BATCH_BYTES:
                yield batch
                batch, size = [], 0
        bar.update(source_size(f))
    if batch:
        yield batch


def _progress_bar(files, progress: bool):
    """A tqdm bar over the sources' bytes (disabled unless `progress`)."""

    return tqdm(
        total=sum(source_size(f) for f in files),
        unit="B",
        unit_scale=True,
        desc="prepare",
        disable=not progress,
        dynamic_ncols=True,
    )


def _packed_meta(
    splits: PackedSplits,
    val_fraction: float,
    *,
    row_len,
    vocab_size,
    dtype,
    tok,
    train_on,
    overflow,
    sources,
    pattern,
    seed,
) -> dict:
    """meta.json of the written splits; DataError when nothing trains or a split is empty."""
    writers, index, first_empty = splits.writers, splits.index, splits.first_empty
    stats = PackStats()
    for w in writers.values():
        stats.add(w.stats)
    if stats.rows == 0:
        where = f" (first: {first_empty})" if first_empty else ""
        raise DataError(
            f"no example has anything to train on: {stats.empty} of {index} examples have an empty loss mask{where}"
        )
    if writers["train"].stats.rows == 0 or writers["val"].stats.rows == 0:
        raise DataError(
            f"{index} examples are too few to split with val_fraction {val_fraction}: "
            f"train has {writers['train'].stats.rows} rows, val "
            f"{writers['val'].stats.rows}"
        )
    meta = {
        "format": "packed",
        "row_len": row_len,
        "vocab_size": vocab_size,
        "dtype": dtype,
        "seg_dtype": seg_dtype(row_len).name,
        "tokenizer": "bytes" if tok is None else tok.path,
        **({} if tok is None else {"tokenizer_kind": tok.kind, "eos_id": tok.eos_id}),
        "max_token_id": max(w.max_token for w in writers.values()),
        "train_tokens": writers["train"].stats.row_tokens,
        "val_tokens": writers["val"].stats.row_tokens,
        "train_rows": writers["train"].stats.rows,
        "val_rows": writers["val"].stats.rows,
        "train_trained_tokens": writers["train"].trained,
        "val_trained_tokens": writers["val"].trained,
        "examples": index,
        "kinds": splits.kinds,
        "empty_skipped": stats.empty,
        "first_empty": first_empty,
        "first_truncated": splits.first_truncated,
        "template_dropped": splits.dropped,
        "first_template_dropped": splits.first_dropped,
        "packing": stats.as_dict(),
        "train_on": train_on,
        "overflow": overflow,
        "sources": sources,
        "pattern": pattern,
        "val_fraction": val_fraction,
        "seed": seed,
        "split": "examples",
    }
    return meta


def _with_template(out: Path, files: dict, meta: dict, template: str | None) -> dict:
    """`files` plus the chat template the chats were rendered with (a temporary file, to be
    committed as chat_template.jinja: `export --hf` ships it); a previous corpus' one goes."""
    (out / "chat_template.jinja").unlink(missing_ok=True)
    if template is not None:
        tmp = out / f".chat_template.jinja.tmp.{os.getpid()}"
        tmp.write_text(template)
        files["chat_template.jinja"] = tmp
        meta["chat_template"] = "chat_template.jinja"
    return files


def prepare_examples(
    sources: Sequence[str | os.PathLike],
    out_dir: str | os.PathLike,
    row_len: int,
    val_fraction: float = 0.05,
    seed: int = 0,
    tokenizer: str = "bytes",
    pattern: str = "*",
    exclude: Sequence[str] = (),
    eos: str | None = None,
    chat_template: str | None = None,
    train_on: str = "targets",
    overflow: str = "truncate",
    threads: int | None = None,
    progress: bool = False,
    workers: int = 1,
    keys: KeyMap = KeyMap(),
) -> dict:
    """Encode chat / instruction / plain examples (`fsdp_jax.app.data.examples`) from `sources`
    and pack them into rows of `row_len` tokens in `out_dir` (module docstring); returns
    meta. `tokenizer`: "bytes" or a tokenizer path (`fsdp_jax.app.data.tokenizer`); its chat
    template comes from beside it unless `chat_template` (a file) is given. `workers` > 1
    renders and tokenizes in that many processes (`fsdp_jax.app.data.encode_pool`), the output
    identical to one worker's; `threads`: the tokenizer's threads (per worker). Sources are
    .jsonl and text files and tables (.parquet, `datasets` directories); `keys`
    (`fsdp_jax.app.data.tables.KeyMap`) names the keys (columns) holding messages, text, prompt
    and completion. Raises
    DataError (one line naming file and line) on bad input, before anything is in place."""

    _check_options(val_fraction, row_len, threads, workers, overflow)
    out = check_out(out_dir)
    files = collect(sources, pattern, exclude)
    if not files:
        raise DataError("empty corpus: no non-empty files found in the sources")
    tok, spec, enc = _encoder(tokenizer, eos, chat_template, train_on, threads)
    vocab = 256 if tok is None else tok.vocab_size
    dtype = token_dtype(vocab)
    created = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    _remove_stale(out)
    splits = PackedSplits(out, row_len, dtype, overflow, seed, val_fraction, PACK_TOKENS)
    bar = _progress_bar(files, progress)
    try:
        for items, examples in encode_batches(spec, _text_batches(files, bar, keys), workers, encoder=enc):
            if examples is None:  # `items` is a long text file: one plain example
                splits.add_stream(_long_tokens(items, tok), f"{items}:1")
            else:
                splits.add_examples(items, examples)
        bar.close()
        splits.close()
        meta = _packed_meta(
            splits,
            val_fraction,
            row_len=row_len,
            vocab_size=vocab,
            dtype=dtype.name,
            tok=tok,
            train_on=train_on,
            overflow=overflow,
            sources=[str(s) for s in sources],
            pattern=pattern,
            seed=seed,
        )
        if not keys.identity:
            meta["keys"] = dataclasses.asdict(keys)
        return commit(out, _with_template(out, splits.tmp_files(), meta, spec.chat_template), meta)
    except (ExampleError, TokenizerError) as e:
        raise DataError(str(e)) from None
    finally:
        bar.close()
        splits.discard()
        if created and out.is_dir() and not any(out.iterdir()):
            out.rmdir()  # bad input: leave no trace
