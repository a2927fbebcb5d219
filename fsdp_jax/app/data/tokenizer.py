"""Real tokenizers for corpora and text samples: a Hugging Face `tokenizer.json`
(the `tokenizers` library) or a SentencePiece `.model`.

    tok = load_tokenizer("path/to/Llama-2-7b-hf")     # a model dir, tokenizer.json or .model
    ids = tok.encode("def f(x):")                      # no BOS/EOS added
    tok.decode(ids); tok.vocab_size; tok.eos_id

`encode_corpus` turns documents into one flat token stream, `encode(doc) + [eos]`
per document (a text file over LONG_BYTES read and encoded in overlapping windows by
`encode_long`, never whole, with the same tokens), encoding batches with the library's own threads (the Rust
`encode_batch` of `tokenizers`, SentencePiece's `num_threads`) and showing a
progress bar. `fsdp_jax.app.data.corpus.prepare_text(..., tokenizer=PATH)` writes it as a
corpus (train.bin/val.bin/meta.json; meta.json records the tokenizer path so the
trainer's text sample decodes with it).
"""

from __future__ import annotations

import codecs
import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from fsdp_jax.app.data.tables import is_table, is_tabular, source_size, table_rows
from fsdp_jax.errors import (
    TokenizerError,
    one_line,
)

# Tried in order when neither --eos nor a tokenizer_config.json names the EOS token.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
BATCH_BYTES = 4 << 20  # text per encode call
LONG_BYTES = 16 << 20  # a text file larger than this is read and encoded as a stream (encode_long)
WINDOW_CHARS = 1 << 20  # text per encode call of a long document
OVERLAP_CHARS = 1 << 13  # text two consecutive windows share; they are cut where they agree


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    path: str  # the file loaded (tokenizer.json or .model), absolute
    kind: str  # "hf" | "sentencepiece"
    vocab_size: int  # 1 + the largest id it can produce
    eos_id: int
    _tok: Any = dataclasses.field(repr=False, compare=False)

    def encode(self, text: str) -> list[int]:
        return self.encode_batch([text])[0]

    def encode_batch(self, texts: list[str], threads: int | None = None) -> list[list[int]]:
        """Token ids per text, no special tokens added (text spelling a special token,
        e.g. "</s>", still becomes that token, as in the libraries)."""
        if self.kind == "hf":
            return [e.ids for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        return self._tok.encode(texts, out_type=int, num_threads=threads or -1)

    def encode_offsets(self, texts: list[str], threads: int | None = None) -> list[tuple[list[int], list[int]]]:
        """(ids, the character index where each token starts) per text, no special tokens
        added. SentencePiece gives byte offsets into the UTF-8 text; they are mapped back
        to characters."""
        return self._encode(texts, threads, with_ends=False)

    def encode_spans(self, texts: list[str], threads: int | None = None) -> list[tuple[list[int], ...]]:
        """(ids, token starts, token ends: character indices) per text, as `encode_offsets`
        (the ends cost one more list per text: only the chat masks ask for them)."""
        return self._encode(texts, threads, with_ends=True)

    def _encode(self, texts: list[str], threads: int | None, with_ends: bool) -> list[tuple[list[int], ...]]:
        if self.kind == "hf":
            encs = self._tok.encode_batch(texts, add_special_tokens=False)
            if not with_ends:
                return [(e.ids, [a for a, _ in e.offsets]) for e in encs]
            return [(e.ids, [a for a, _ in e.offsets], [b for _, b in e.offsets]) for e in encs]
        out = []
        for text, proto in zip(texts, self._tok.encode(texts, return_type="proto", num_threads=threads or -1)):
            char_of = np.repeat(
                np.arange(len(text) + 1), [len(c.encode("utf-8", errors="replace")) for c in text] + [1]
            )
            last = len(char_of) - 1
            row = ([p.id for p in proto.pieces], [int(char_of[min(p.begin, last)]) for p in proto.pieces])
            if with_ends:
                row += ([int(char_of[min(p.end, last)]) for p in proto.pieces],)
            out.append(row)
        return out

    def decode(self, ids: Iterable[int]) -> str:
        ids = [int(i) for i in ids]
        if self.kind == "hf":
            return self._tok.decode(ids, skip_special_tokens=False)
        return self._tok.decode(ids)


def tokenizer_file(path: str | os.PathLike) -> tuple[Path, str]:
    """(file, kind) for a tokenizer.json, a SentencePiece .model, or a directory with
    either (a Hugging Face model directory)."""
    p = Path(path).expanduser()
    if p.is_dir():
        for name, kind in (("tokenizer.json", "hf"), ("tokenizer.model", "sentencepiece")):
            if (p / name).is_file():
                return (p / name).resolve(), kind
        raise TokenizerError(f"tokenizer {str(path)!r}: directory has no tokenizer.json or tokenizer.model")
    if not p.is_file():
        raise TokenizerError(f"tokenizer {str(path)!r}: not found")
    return p.resolve(), ("hf" if p.suffix == ".json" else "sentencepiece")


def _named_eos(file: Path) -> str | None:
    cfg = file.parent / "tokenizer_config.json"
    if not cfg.is_file():
        return None
    try:
        eos = json.loads(cfg.read_text()).get("eos_token")
    except (OSError, ValueError, AttributeError):
        return None
    return eos.get("content") if isinstance(eos, dict) else eos


def load_tokenizer(path: str | os.PathLike, eos: str | None = None, require_eos: bool = True) -> Tokenizer:
    """Load a tokenizer; `eos` names the end-of-document token (default: the
    tokenizer_config.json beside it, the SentencePiece model's eos, or a common name).
    Without `require_eos` (decoding only) a missing EOS gives eos_id -1."""
    file, kind = tokenizer_file(path)
    if kind == "hf":
        from tokenizers import Tokenizer as HFTokenizer

        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust loader raises bare Exception on bad JSON
            raise TokenizerError(
                f"tokenizer {str(file)!r}: cannot load as a Hugging Face tokenizer.json ({one_line(e, 160)})"
            ) from None
        vocab = tok.get_vocab(with_added_tokens=True)
        if not vocab:
            raise TokenizerError(f"tokenizer {str(file)!r}: the vocabulary is empty")
        names = [eos] if eos else [n for n in (_named_eos(file),) if n] + list(EOS_CANDIDATES)
        eos_id = next((vocab[n] for n in names if n in vocab), None)
        size = max(vocab.values()) + 1
    else:
        import sentencepiece as spm

        try:
            tok = spm.SentencePieceProcessor(model_file=str(file))
        except (OSError, RuntimeError) as e:
            raise TokenizerError(
                f"tokenizer {str(file)!r}: cannot load as a SentencePiece model ({one_line(e, 160)})"
            ) from None
        size = tok.get_piece_size()
        if eos:
            eos_id = tok.piece_to_id(eos)
            eos_id = None if eos_id == tok.unk_id() and eos != tok.id_to_piece(tok.unk_id()) else eos_id
        else:
            eos_id = tok.eos_id() if tok.eos_id() >= 0 else None
    if eos_id is None and not require_eos:
        eos_id = -1
    if eos_id is None:
        raise TokenizerError(
            f"tokenizer {str(file)!r}: no EOS token {'named ' + repr(eos) if eos else 'found'}; pass --eos TOKEN"
        )
    return Tokenizer(str(file), kind, int(size), int(eos_id), tok)


def is_long(file: Path) -> bool:
    """A text file (not .jsonl, not a table) over LONG_BYTES: read and encoded as a stream, never whole."""

    return not is_tabular(file) and file.stat().st_size > LONG_BYTES


def text_chunks(file: Path, chunk_bytes: int | None = None) -> Iterator[str]:
    """A text file's text, `chunk_bytes` (default WINDOW_CHARS) of it at a time; bytes that are not UTF-8 are
    replaced (U+FFFD) exactly as decoding the whole file would replace them."""
    dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
    with open(file, "rb") as fh:
        while True:
            raw = fh.read(chunk_bytes or WINDOW_CHARS)
            text = dec.decode(raw, final=not raw)
            if text:
                yield text
            if not raw:
                return


def _agree(cur: tuple[np.ndarray, np.ndarray], nxt: tuple[np.ndarray, np.ndarray], lo: int, hi: int) -> int | None:
    """A character position p in [lo, hi] where both encodings (ids, absolute token starts)
    start a token, and agree on the token before p and the two from p; None if none."""
    (ci, cs), (ni, ns) = cur, nxt
    first = np.ones(len(cs), bool)
    first[1:] = cs[1:] != cs[:-1]  # byte-fallback tokens of one character share its start
    cand = cs[first & (cs >= lo) & (cs <= hi)]
    for p in cand[np.argsort(np.abs(cand - (lo + hi) // 2), kind="stable")]:
        i, j = int(np.searchsorted(cs, p)), int(np.searchsorted(ns, p))
        if (
            i >= 1
            and j >= 1
            and j < len(ns)
            and ns[j] == p
            and i + 2 <= len(ci)
            and j + 2 <= len(ni)
            and (ci[i - 1 : i + 2] == ni[j - 1 : j + 2]).all()
            and (cs[i - 1 : i + 2] == ns[j - 1 : j + 2]).all()
        ):
            return int(p)
    return None


def encode_long(
    tok: Tokenizer, chunks: Iterable[str], window: int | None = None, overlap: int | None = None
) -> Iterator[np.ndarray]:
    """The token ids of one document given as text chunks, as int64 arrays in order whose
    concatenation is `tok.encode("".join(chunks))`, in memory bounded by `window`.

    The text is encoded in windows of about `window` characters; consecutive windows
    overlap by `overlap` characters, and the first window's tokens are kept up to a
    position p in the middle of the overlap where both encodings start a token and agree
    on the tokens around p (the second window's from p on). Tokenizers are local (BPE
    merges and SentencePiece pieces stay within pre-tokens / a few characters), so far
    from both windows' edges each equals the whole text's encoding; where no such p
    exists (one pre-token longer than the overlap) the window grows until one does."""
    window = window or WINDOW_CHARS
    overlap = min(overlap or OVERLAP_CHARS, window // 2)
    q = overlap // 4
    it = iter(chunks)
    buf, base, more = "", 0, True  # buf: the text from absolute character `base`

    def fill(upto: int) -> None:
        nonlocal buf, more
        parts, n = [buf], len(buf)
        while more and base + n < upto:
            c = next(it, None)
            if c is None:
                more = False
            else:
                parts.append(c)
                n += len(c)
        buf = "".join(parts)

    def enc(start: int, stop: int) -> tuple[np.ndarray, np.ndarray]:  # absolute token starts
        text = buf[start - base : stop - base]
        ids, starts = tok.encode_offsets([text])[0] if text else ([], [])
        return np.asarray(ids, np.int64), np.asarray(starts, np.int64) + start

    a0 = 0  # tokens before a0 are emitted
    fill(window)
    end = min(base + len(buf), window)
    cur = enc(0, end)  # the window [base, end)
    while more or end < base + len(buf):
        nb = end - overlap
        fill(nb + window)
        nxt_end = min(base + len(buf), nb + window)
        nxt = enc(nb, nxt_end)
        p = _agree(cur, nxt, nb + q, end - q)
        if p is None:  # no safe cut in this overlap: the window grows
            end = nxt_end
            cur = enc(base, end)
            continue
        ids, starts = cur
        yield ids[(starts >= a0) & (starts < p)]
        a0, cur, end, buf, base = p, nxt, nxt_end, buf[nb - base :], nb
    ids, starts = cur
    yield ids[starts >= a0]


def read_documents(file: Path, text_key: str = "text") -> Iterator[str]:
    """A text file is one document (read whole); a .jsonl file holds one per line
    ({"text": ...}, or the key `text_key`), read as a stream, and a table (a .parquet file,
    a `datasets` directory: `fsdp_jax.app.data.tables`) one per row. Bytes that are not UTF-8 are
    replaced (U+FFFD)."""

    if is_table(file):
        for n, row in table_rows(file):
            yield _text_of(row, file, n, text_key)
        return
    if file.suffix != ".jsonl":
        yield file.read_bytes().decode("utf-8", errors="replace")
        return
    with open(file, "rb") as fh:
        lines = (raw.decode("utf-8", errors="replace") for raw in fh)
        yield from _jsonl_texts(file, lines, text_key)


def _text_of(rec, file: Path, n: int, text_key: str) -> str:
    text = rec.get(text_key) if isinstance(rec, dict) else None
    if not isinstance(text, str):
        got = "no such key" if not isinstance(rec, dict) or text_key not in rec else f"a {type(text).__name__}"
        raise TokenizerError(f'{file}:{n}: expected a JSON object with a "{text_key}" string ({got})')
    return text


def _jsonl_texts(file: Path, lines: Iterable[str], text_key: str = "text") -> Iterator[str]:
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except ValueError:
                raise TokenizerError(f'{file}:{n}: expected a JSON object with a "{text_key}" string') from None
            yield _text_of(rec, file, n, text_key)


def encode_corpus(
    tok: Tokenizer,
    files: list[Path],
    write: Callable[[np.ndarray], None],
    threads: int | None = None,
    progress: bool = True,
    text_key: str = "text",
) -> tuple[int, int]:
    """Encode `files` in order, calling `write(ids)` with `encode(doc) + [eos]` per
    batch of documents (`read_documents(file, text_key)`); returns (documents, tokens)."""

    bar = tqdm(
        total=sum(source_size(f) for f in files),
        unit="B",
        unit_scale=True,
        desc="tokenize",
        disable=not progress,
        dynamic_ncols=True,
    )
    docs = tokens = 0
    batch: list[str] = []
    size = 0

    def flush():
        nonlocal docs, tokens
        if batch:
            ids = [i for enc in tok.encode_batch(batch, threads) for i in (*enc, tok.eos_id)]
            write(np.asarray(ids, np.int64))
            docs, tokens = docs + len(batch), tokens + len(ids)
            batch.clear()

    for f in files:
        if is_long(f):  # one document, read and encoded as a stream
            flush()
            size = n = 0
            for ids in encode_long(tok, text_chunks(f)):
                write(ids)
                n += len(ids)
            write(np.asarray([tok.eos_id], np.int64))
            docs, tokens = docs + 1, tokens + n + 1
            bar.update(f.stat().st_size)
            continue
        for doc in read_documents(f, text_key):
            batch.append(doc)
            size += len(doc)
            if size >= BATCH_BYTES:
                flush()
                size = 0
        bar.update(source_size(f))
    flush()
    bar.close()
    return docs, tokens
