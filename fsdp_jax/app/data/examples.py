"""Fine-tuning examples: chat, instruction and plain text, as tokens plus a loss mask.

One `.jsonl` line is one example, its format told by its keys:

    {"messages": [{"role": "user", "content": ...}, {"role": "assistant", ...}]}   chat
    {"prompt": ..., "completion": ...}                                            instruction
    {"text": ...}                                                                 plain text

and a text file (any other suffix) is one plain example. Every tokenizer reads the
same examples (the byte tokenizer included: it encodes the parsed text as UTF-8).

Chat is rendered with the model's own chat template (`chat_template` in
tokenizer_config.json, or chat_template.jinja beside the tokenizer) exactly as
transformers' `apply_chat_template(messages, tokenize=False)` renders it: a jinja2
`ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with its
`tojson`, `raise_exception`, `strftime_now`, loop controls and the `generation`
tag, given the tokenizer's special tokens (`bos_token`, `eos_token`, ...). The text
is then tokenized whole, with no special tokens added (transformers does the same),
so the ids equal `apply_chat_template(messages)`.

The loss mask marks the tokens the model is trained to predict (1 = a target):
chat: every assistant turn (the text a turn adds after the prompt for it: rendering
`messages[:i]` with `add_generation_prompt=True`, then `messages[:i+1]`; the turn's
end-of-turn marker included); instruction: the completion and the EOS after it;
plain: everything. `train_on="all"` marks every token instead.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_jax.errors import (
    ExampleError,
    one_line,
)

ROLES = ("system", "user", "assistant", "tool")
TRAIN_ON = ("targets", "all")  # targets: assistant turns / completions / plain text; all: every token
SPECIAL_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


@dataclasses.dataclass(frozen=True)
class Example:
    tokens: np.ndarray  # int32 (n,)
    mask: np.ndarray  # uint8 (n,): 1 where the token is a training target
    kind: str  # chat | instruction | plain


def read_records(file: Path) -> Iterator[tuple[int, Any]]:
    """(line number, parsed record) per non-blank line of a .jsonl file, read as a
    stream; a text file is one record {"text": ...} at line 1. Bad JSON raises
    ExampleError naming the file and line."""
    if file.suffix != ".jsonl":
        yield 1, {"text": file.read_bytes().decode("utf-8", errors="replace")}
        return
    with open(file, "rb") as fh:
        for n, raw in enumerate(fh, 1):
            line = raw.decode("utf-8", errors="replace")
            if not line.strip():
                continue
            try:
                yield n, json.loads(line)
            except ValueError as e:
                raise ExampleError(f"{file}:{n}: not JSON ({str(e).split(':')[0]})") from None


def record_kind(rec: Any, where: str) -> str:
    """chat | instruction | plain, or ExampleError naming `where` (file:line)."""
    if not isinstance(rec, dict):
        raise ExampleError(f'{where}: expected a JSON object with "messages", "prompt" and "completion", or "text"')
    if "messages" in rec:
        msgs = rec["messages"]
        if not isinstance(msgs, list) or not msgs:
            raise ExampleError(f'{where}: "messages" must be a non-empty list')
        for i, m in enumerate(msgs):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
                raise ExampleError(f'{where}: message {i} needs a "role" and a "content" string')
            if m["role"] not in ROLES:
                raise ExampleError(f"{where}: message {i} has unknown role {m['role']!r} (allowed: {', '.join(ROLES)})")
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


def compile_template(source: str):
    """The template compiled in transformers' environment (see the module docstring)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %}...{% endgeneration %}: renders its body
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            return caller()

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class ChatRenderer:
    """`render(messages, add_generation_prompt)` -> text, as transformers renders it."""

    def __init__(self, source: str, specials: dict[str, str]):
        try:
            self.template = compile_template(source)
        except Exception as e:  # jinja2.TemplateSyntaxError
            raise ExampleError(f"chat template: does not compile ({one_line(e, 160)})") from None
        self.specials = specials

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **self.specials
        )

    def spans(self, messages: list[dict], where: str) -> tuple[str, list[tuple[int, int]]]:
        """(the conversation's text, the [start, end) character spans of its assistant turns)."""
        try:
            text = self.render(messages)
            spans = []
            for i, m in enumerate(messages):
                if m["role"] != "assistant":
                    continue
                before = self.render(messages[:i], add_generation_prompt=True)
                upto = text if i == len(messages) - 1 else self.render(messages[: i + 1])
                if not (text.startswith(upto) and upto.startswith(before)):
                    raise ExampleError(
                        f"{where}: the chat template does not render the conversation "
                        f"as a growing prefix (assistant turn {i}), so its loss mask "
                        "cannot be found"
                    )
                spans.append((len(before), len(upto)))
        except ExampleError:
            raise
        except Exception as e:  # jinja2.TemplateError (raise_exception), TypeError, ...
            raise ExampleError(
                f"{where}: the chat template fails to render ({type(e).__name__}: {one_line(e, 160)})"
            ) from None
        return text, spans


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

    def texts(self, rec: dict, where: str) -> tuple[str, list[tuple[int, int]], str, bool]:
        """(text, trained character spans, kind, append EOS)."""
        kind = record_kind(rec, where)
        if kind == "chat":
            if self.chat is None:
                raise ExampleError(
                    f"{where}: a chat example needs a chat template (the tokenizer "
                    "has none: add chat_template.jinja beside it or pass --chat-template)"
                )
            text, spans = self.chat.spans(rec["messages"], where)
            return text, spans, kind, False
        if kind == "instruction":
            p, c = rec["prompt"], rec["completion"]
            return p + c, [(len(p), len(p) + len(c))], kind, True
        return rec["text"], [(0, len(rec["text"]))], kind, True

    def encode_batch(self, items: list[tuple[dict, str]], threads: int | None = None) -> list[Example]:
        """`items`: (record, "file:line"); one Example per record (the mask may be empty)."""
        parsed = [self.texts(rec, where) for rec, where in items]
        if self.tok is None:
            enc = [_byte_offsets(t) for t, *_ in parsed]
        else:
            enc = self.tok.encode_offsets([t for t, *_ in parsed], threads)
        out = []
        for (text, spans, kind, eos), (ids, starts) in zip(parsed, enc):
            ids = np.asarray(list(ids) + (self.eos if eos else []), np.int32)
            starts = np.asarray(list(starts) + ([len(text)] if eos and self.eos else []), np.int64)
            if self.train_on == "all":
                mask = np.ones(len(ids), np.uint8)
            else:
                mask = np.zeros(len(ids), np.uint8)
                for a, b in spans:
                    # a token is trained when it starts inside the span; the EOS after an
                    # instruction's completion or a plain text (start == len(text)) too
                    mask |= ((starts >= a) & ((starts < b) | (starts == len(text)) & eos)).astype(np.uint8)
            out.append(Example(ids, mask, kind))
        return out


def _byte_offsets(text: str) -> tuple[np.ndarray, np.ndarray]:
    """UTF-8 bytes of `text` and, per byte, the index of the character it belongs to."""
    data = text.encode("utf-8", errors="replace")
    lens = np.fromiter((len(ch.encode("utf-8", errors="replace")) for ch in text), np.int64, len(text))
    return np.frombuffer(data, np.uint8).astype(np.int32), np.repeat(np.arange(len(text)), lens)
