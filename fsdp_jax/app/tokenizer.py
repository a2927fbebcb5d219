"""Real tokenizers for corpora and text samples: a Hugging Face `tokenizer.json`
(the `tokenizers` library) or a SentencePiece `.model`.

    tok = load_tokenizer("path/to/Llama-2-7b-hf")     # a model dir, tokenizer.json or .model
    ids = tok.encode("def f(x):")                      # no BOS/EOS added
    tok.decode(ids); tok.vocab_size; tok.eos_id

`encode_corpus` turns documents into one flat token stream, `encode(doc) + [eos]`
per document, encoding batches with the library's own threads (the Rust
`encode_batch` of `tokenizers`, SentencePiece's `num_threads`) and showing a
progress bar. `fsdp_jax.app.data.prepare_text(..., tokenizer=PATH)` writes it as a
corpus (train.bin/val.bin/meta.json; meta.json records the tokenizer path so the
trainer's text sample decodes with it).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
from fsdp_jax.errors import TokenizerError  # noqa: F401 (re-exported)

# Tried in order when neither --eos nor a tokenizer_config.json names the EOS token.
EOS_CANDIDATES = ("</s>", "<|endoftext|>", "<|end_of_text|>", "<eos>", "<|eot_id|>")
BATCH_BYTES = 4 << 20  # text per encode call


@dataclasses.dataclass(frozen=True)
class Tokenizer:
    path: str            # the file loaded (tokenizer.json or .model), absolute
    kind: str            # "hf" | "sentencepiece"
    vocab_size: int      # 1 + the largest id it can produce
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

    def encode_offsets(self, texts: list[str], threads: int | None = None
                       ) -> list[tuple[list[int], list[int]]]:
        """(ids, the character index where each token starts) per text, no special tokens
        added. SentencePiece gives byte offsets into the UTF-8 text; they are mapped back
        to characters."""
        if self.kind == "hf":
            return [(e.ids, [a for a, _ in e.offsets])
                    for e in self._tok.encode_batch(texts, add_special_tokens=False)]
        out = []
        for text, proto in zip(texts, self._tok.encode(texts, return_type="proto", num_threads=threads or -1)):
            char_of = np.repeat(np.arange(len(text) + 1), [len(c.encode("utf-8", errors="replace"))
                                                            for c in text] + [1])
            out.append(([p.id for p in proto.pieces], [int(char_of[min(p.begin, len(char_of) - 1)])
                                                       for p in proto.pieces]))
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
        raise TokenizerError(f"tokenizer {str(path)!r}: directory has no tokenizer.json or "
                             "tokenizer.model")
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


def load_tokenizer(path: str | os.PathLike, eos: str | None = None, require_eos: bool = True
                   ) -> Tokenizer:
    """Load a tokenizer; `eos` names the end-of-document token (default: the
    tokenizer_config.json beside it, the SentencePiece model's eos, or a common name).
    Without `require_eos` (decoding only) a missing EOS gives eos_id -1."""
    file, kind = tokenizer_file(path)
    if kind == "hf":
        from tokenizers import Tokenizer as HFTokenizer
        try:
            tok = HFTokenizer.from_file(str(file))
        except Exception as e:  # the Rust loader raises bare Exception on bad JSON
            raise TokenizerError(f"tokenizer {str(file)!r}: cannot load as a Hugging Face "
                                 f"tokenizer.json ({' '.join(str(e).split())[:160]})") from None
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
            raise TokenizerError(f"tokenizer {str(file)!r}: cannot load as a SentencePiece "
                                 f"model ({' '.join(str(e).split())[:160]})") from None
        size = tok.get_piece_size()
        if eos:
            eos_id = tok.piece_to_id(eos)
            eos_id = None if eos_id == tok.unk_id() and eos != tok.id_to_piece(tok.unk_id()) else eos_id
        else:
            eos_id = tok.eos_id() if tok.eos_id() >= 0 else None
    if eos_id is None and not require_eos:
        eos_id = -1
    if eos_id is None:
        raise TokenizerError(f"tokenizer {str(file)!r}: no EOS token "
                             f"{'named ' + repr(eos) if eos else 'found'}; pass --eos TOKEN")
    return Tokenizer(str(file), kind, int(size), int(eos_id), tok)


def read_documents(file: Path) -> Iterator[str]:
    """A text file is one document (read whole); a .jsonl file holds one per line
    ({"text": ...}), read as a stream. Bytes that are not UTF-8 are replaced (U+FFFD)."""
    if file.suffix != ".jsonl":
        yield file.read_bytes().decode("utf-8", errors="replace")
        return
    with open(file, "rb") as fh:
        lines = (raw.decode("utf-8", errors="replace") for raw in fh)
        yield from _jsonl_texts(file, lines)


def _jsonl_texts(file: Path, lines: Iterable[str]) -> Iterator[str]:
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield json.loads(line)["text"]
            except (ValueError, KeyError, TypeError):
                raise TokenizerError(f"{file}:{n}: expected a JSON object with a \"text\" "
                                     "string") from None


def encode_corpus(tok: Tokenizer, files: list[Path], write: Callable[[np.ndarray], None],
                  threads: int | None = None, progress: bool = True) -> tuple[int, int]:
    """Encode `files` in order, calling `write(ids)` with `encode(doc) + [eos]` per
    batch of documents; returns (documents, tokens)."""
    from tqdm import tqdm

    bar = tqdm(total=sum(f.stat().st_size for f in files), unit="B", unit_scale=True,
               desc="tokenize", disable=not progress, dynamic_ncols=True)
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
        for doc in read_documents(f):
            batch.append(doc)
            size += len(doc)
            if size >= BATCH_BYTES:
                flush()
                size = 0
        bar.update(f.stat().st_size)
    flush()
    bar.close()
    return docs, tokens
