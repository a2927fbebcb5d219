"""Fine-tuning examples: chat, instruction and plain text, as tokens plus a loss mask.

One `.jsonl` line is one example, its format told by its keys:

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}   chat
    {"prompt": ..., "completion": ...}                                            instruction
    {"text": ...}                                                                 plain text

and a text file (any other suffix) is one plain example. Every tokenizer reads the
same examples (the byte tokenizer included: it encodes the parsed text as UTF-8).

Chat is rendered with the model's own chat template (`chat_template` in
tokenizer_config.json, or chat_template.jinja beside the tokenizer) exactly as
transformers 5's `apply_chat_template(messages, tokenize=False)` renders it
(`fsdp_jax.app.data.chat_template`: null-valued keys dropped, `thinking` / `reasoning` passed as
`reasoning_content`, the conversation rendered once), given the tokenizer's special tokens
(`bos_token`, `eos_token`, ...). The text is then tokenized whole, with no special tokens
added (transformers does the same), so the ids equal `apply_chat_template(messages)`.

The loss mask marks the tokens the model is trained to predict (1 = a target):
chat: every token overlapping an assistant turn (`fsdp_jax.app.data.chat_template` finds them:
the template's `{% generation %}` blocks, as transformers' `return_assistant_tokens_mask`,
or the text a turn adds after the generation prompt for it, its end-of-turn marker
included); instruction: the completion and the EOS after it; plain: everything.
`train_on="all"` marks every token instead. An example whose template leaves some message
text out (Mistral v0.3 renders a system prompt only when the chat ends with a user turn) is
trained as rendered and marked `dropped`.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_jax.app.data.chat_template import ChatRenderer, check_messages, normalize_messages
from fsdp_jax.app.data.tables import KeyMap, is_table, table_rows
from fsdp_jax.errors import ExampleError

TRAIN_ON = ("targets", "all")  # targets: assistant turns / completions / plain text; all: every token
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class Example:
    tokens: np.ndarray  # int32 (n,)
    mask: np.ndarray  # uint8 (n,): 1 where the token is a training target
    kind: str  # chat | instruction | plain
    dropped: bool = False  # chat: the template left some message text out (trained as rendered)


def read_records(file: Path, keys: KeyMap = KeyMap()) -> Iterator[tuple[int, Any]]:
    """(line number, parsed record) per non-blank line of a .jsonl file, read as a
    stream, or per row of a table (a .parquet file or a `datasets` directory:
    `fsdp_jax.app.data.tables`, a batch of rows at a time); a text file is one record
    {"text": ...} at line 1. `keys` renames the source's keys to the record keys. Bad JSON
    raises ExampleError naming the file and line."""
    if is_table(file):
        for n, row in table_rows(file):
            yield n, keys.apply(row, f"{file}:{n}")
        return
    if file.suffix != ".jsonl":
        yield 1, {"text": file.read_bytes().decode("utf-8", errors="replace")}
        return
    with open(file, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise ExampleError(f"{file}:{n}: not JSON ({str(e).split(':')[0]})") from None
            yield n, keys.apply(rec, f"{file}:{n}")


def record_kind(rec: Any, where: str) -> str:
    """chat | instruction | plain, or ExampleError naming `where` (file:line)."""
    if not isinstance(rec, dict):
        raise ExampleError(f'{where}: expected a JSON object with "messages", "prompt" and "completion", or "text"')
    if "messages" in rec:
        check_messages(normalize_messages(rec["messages"]) if isinstance(rec["messages"], list) else None, where)
        return "chat"
    if "prompt" in rec or "completion" in rec:
        if not isinstance(rec.get("prompt"), str) or not isinstance(rec.get("completion"), str):
            raise ExampleError(f'{where}: an instruction needs "prompt" and "completion" strings')
        return "instruction"
    if isinstance(rec.get("text"), str):
        return "plain"
    raise ExampleError(f'{where}: expected "messages", "prompt"+"completion" or a "text" string')


# ----------------------------------------------------------------------------- chat templates


def find_chat_template(tokenizer_path: str | Path) -> str | None:
    """The chat template beside a tokenizer: chat_template.jinja, else tokenizer_config.json's
    `chat_template` (a string, or the "default" entry of a list of named templates)."""
    d = Path(tokenizer_path)
    d = d if d.is_dir() else d.parent
    if (d / "chat_template.jinja").is_file():
        return (d / "chat_template.jinja").read_text()
    cfg = d / "tokenizer_config.json"
    if cfg.is_file():
        tpl = json.loads(cfg.read_text()).get("chat_template")
        if isinstance(tpl, list):  # [{"name": "default", "template": ...}, ...]
            tpl = next((t.get("template") for t in tpl if t.get("name") == "default"), None)
        return tpl if isinstance(tpl, str) else None
    return None


def special_tokens(tokenizer_path: str | Path) -> dict[str, str]:
    """bos_token, eos_token, ... from tokenizer_config.json, as transformers passes them to
    a chat template (its `special_tokens_map`)."""
    d = Path(tokenizer_path)
    cfg = (d if d.is_dir() else d.parent) / "tokenizer_config.json"
    if not cfg.is_file():
        return {}
    raw = json.loads(cfg.read_text())
    out = {}
    for k in SPECIAL_KEYS:
        v = raw.get(k)
        v = v.get("content") if isinstance(v, dict) else v
        if isinstance(v, str):
            out[k] = v
    return out


# ----------------------------------------------------------------------------- encoding


class ExampleEncoder:
    """Records -> `Example`s for one tokenizer (`fsdp_jax.app.data.tokenizer.Tokenizer`, or
    None for bytes) and chat template (None: chat examples are refused)."""

    def __init__(
        self, tok=None, chat_template: str | None = None, specials: dict | None = None, train_on: str = "targets"
    ):
        if train_on not in TRAIN_ON:
            raise ExampleError(f"train_on {train_on!r}: allowed {', '.join(TRAIN_ON)}")
        self.tok, self.train_on = tok, train_on
        self.eos = [] if tok is None else [tok.eos_id]
        self.chat = None if chat_template is None else ChatRenderer(chat_template, specials or {})

    def texts(self, rec: dict, where: str) -> _Text:
        """The record's text and trained character spans."""
        kind = record_kind(rec, where)
        if kind == "chat":
            if self.chat is None:
                raise ExampleError(
                    f"{where}: a chat example needs a chat template (the tokenizer "
                    "has none: add chat_template.jinja beside it or pass --chat-template)"
                )
            chat = self.chat.spans(normalize_messages(rec["messages"]), where)
            return _Text(chat.text, chat.spans, kind, eos=False, overlap=True, dropped=chat.dropped)
        if kind == "instruction":
            p, c = rec["prompt"], rec["completion"]
            return _Text(p + c, [(len(p), len(p) + len(c))], kind)
        return _Text(rec["text"], [(0, len(rec["text"]))], kind)

    def encode_batch(self, items: list[tuple[dict, str]], threads: int | None = None) -> list[Example]:
        """`items`: (record, "file:line"); one Example per record (the mask may be empty)."""
        parsed = [self.texts(rec, where) for rec, where in items]
        if self.tok is None:
            enc = [_byte_offsets(t.text) for t in parsed]
        elif any(t.overlap for t in parsed):  # chat masks need the tokens' ends too
            enc = self.tok.encode_spans([t.text for t in parsed], threads)
        else:
            enc = [(ids, starts, starts) for ids, starts in self.tok.encode_offsets([t.text for t in parsed], threads)]
        out = []
        for t, (ids, starts, ends) in zip(parsed, enc):
            eos = t.eos and bool(self.eos)
            ids = np.asarray(list(ids) + (self.eos if t.eos else []), np.int32)
            starts = np.asarray(list(starts) + ([len(t.text)] if eos else []), np.int64)
            ends = np.asarray(list(ends) + ([len(t.text)] if eos else []), np.int64)
            if self.train_on == "all":
                mask = np.ones(len(ids), np.uint8)
            else:
                mask = np.zeros(len(ids), np.uint8)
                for a, b in t.spans:
                    if t.overlap:  # chat: every token overlapping the turn, as transformers masks
                        mask |= ((ends > a) & (starts < b)).astype(np.uint8)
                    else:  # a token starting in the span; the EOS after a completion or a text too
                        mask |= ((starts >= a) & ((starts < b) | (starts == len(t.text)) & t.eos)).astype(np.uint8)
            out.append(Example(ids, mask, t.kind, t.dropped))
        return out


@dataclasses.dataclass(frozen=True)
class _Text:
    text: str
    spans: list  # trained [start, end) character spans
    kind: str
    eos: bool = True  # append the tokenizer's EOS (instruction, plain)
    overlap: bool = False  # train the tokens overlapping a span (chat) rather than those starting in it
    dropped: bool = False


def _byte_offsets(text: str) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """UTF-8 bytes of `text` and, per byte, the [start, end) of the character it belongs to."""
    data = text.encode("utf-8", errors="replace")
    lens = np.fromiter((len(ch.encode("utf-8", errors="replace")) for ch in text), np.int64, len(text))
    starts = np.repeat(np.arange(len(text)), lens)
    return np.frombuffer(data, np.uint8).astype(np.int32), starts, starts + 1
