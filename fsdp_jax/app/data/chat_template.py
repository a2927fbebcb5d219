"""Chat templates rendered as transformers 5 renders them, and the assistant turns found in
the rendering.

    r = ChatRenderer(source, {"bos_token": "<s>", "eos_token": "</s>"})
    chat = r.spans(normalize_messages(messages), "chats.jsonl:3")
    chat.text, chat.spans, chat.dropped      # the text, [start, end) per assistant turn, lost text?

Messages are first normalized as transformers' `apply_chat_template` does: keys whose value
is None are dropped (OpenAI exports write `"tool_calls": null`, `"content": null`), and a
message's reasoning under `reasoning_content`, `thinking` or `reasoning` is passed under
`reasoning_content` (and `thinking`). The template is compiled in transformers' environment:
a jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with its
`tojson`, `raise_exception`, `strftime_now`, loop controls and `{% generation %}` tag; a
conversation is rendered once, whole, and that text is what is trained.

An assistant turn's span is found three ways, each exact for the templates it applies to:
1. `{% generation %}` blocks: the template marks the turns itself; the spans are the
   blocks' output positions, as transformers records them for `return_assistant_tokens_mask`.
2. Growing prefix (most templates): the turn is what rendering `messages[:i+1]` adds to
   rendering `messages[:i]` with the generation prompt, its end-of-turn marker included.
3. Otherwise (Qwen3 drops earlier turns' reasoning, Phi-3.5 closes a chat with its EOS,
   Mistral v0.3 renders the system prompt only when the chat ends with a user turn): the turn
   starts after the generation prompt (rendering `messages[:i]` with it must be a prefix of
   the conversation, once messages the template drops whole are left out), and ends where
   the conversation's rendered pieces stop agreeing with those of `messages[:i+1]` after the
   piece that holds the turn's start. A piece is one output of the template (`generate()`),
   so a closing EOS or the next message's header never counts as the turn's.
A conversation whose turns none of these finds is refused (ExampleError, one line).
`dropped` is True when some message text (a system prompt, an earlier turn's reasoning) does
not appear in the rendering: the template left it out, and training sees what it renders.
"""

from __future__ import annotations

import dataclasses
import json
import re
from contextvars import ContextVar
from datetime import datetime

from fsdp_jax.errors import ExampleError, one_line

ROLES = ("system", "user", "assistant", "tool")
REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers' names, in its order
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
_TAG = re.compile(r"<[^<>\s]{1,40}>")  # markup the check for lost text looks through (<think>, ...)


def _now() -> datetime:  # strftime_now's clock (tests fix it)
    return datetime.now()


def normalize_messages(messages: list) -> list:
    """Messages as transformers 5 hands them to a template: None-valued keys dropped, then the
    reasoning (`reasoning_content`, `thinking` or `reasoning`, first not None) under
    `thinking` and `reasoning_content`. Anything that is not a dict is left for the check."""
    out = []
    for m in messages:
        if isinstance(m, dict):
            m = {k: v for k, v in m.items() if v is not None}
            reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
            if reasoning is not None:
                m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def check_messages(messages, where: str) -> None:
    """ExampleError naming `where` unless `messages` (normalized) is a non-empty list of
    messages with a known role and a content string (an assistant turn with `tool_calls`
    may have none)."""
    if not isinstance(messages, list) or not messages:
        raise ExampleError(f'{where}: "messages" must be a non-empty list')
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ExampleError(f'{where}: message {i} needs a "role" and a "content" string')
        if m["role"] not in ROLES:
            raise ExampleError(f"{where}: message {i} has unknown role {m['role']!r} (allowed: {', '.join(ROLES)})")
        if "content" in m and not isinstance(m["content"], str):
            raise ExampleError(f'{where}: message {i} needs a "role" and a "content" string')
        if "content" not in m and not (m["role"] == "assistant" and m.get("tool_calls")):
            raise ExampleError(f'{where}: message {i} needs a "role" and a "content" string (or "tool_calls")')
        r = m.get("reasoning_content")
        if r is not None and not isinstance(r, str):
            raise ExampleError(f"{where}: message {i}'s reasoning must be a string, not {type(r).__name__}")


_TRACKING: ContextVar = ContextVar("fsdp_jax_generation", default=None)


def compile_template(source: str):
    """The template compiled in transformers' environment (see the module docstring)."""
    import jinja2
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class Generation(Extension):  # {% generation %}: renders its body and records where it went
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

        def _body(self, caller):
            rv = caller()
            tracking = _TRACKING.get()
            if tracking is not None:  # as transformers: the position is the text yielded so far
                blocks, spans = tracking
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(rv)))
            return rv

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[Generation, loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: _now().strftime(fmt)
    return env.from_string(source)


@dataclasses.dataclass(frozen=True)
class ChatText:
    text: str  # the conversation rendered once
    spans: list  # [start, end) character spans of its assistant turns, in order
    dropped: bool  # some message text does not appear in `text` (the template left it out)


class ChatRenderer:
    """`render(messages, add_generation_prompt)` -> text, as transformers renders it;
    `spans(messages, where)` -> `ChatText` (module docstring)."""

    def __init__(self, source: str, specials: dict[str, str]):
        try:
            self.template = compile_template(source)
        except Exception as e:  # jinja2.TemplateSyntaxError
            raise ExampleError(f"chat template: does not compile ({one_line(e, 160)})") from None
        self.specials = specials
        self.has_generation = bool(_GENERATION_TAG.search(source))

    def _vars(self, messages, add_generation_prompt):
        return dict(
            messages=messages, tools=None, documents=None, add_generation_prompt=add_generation_prompt, **self.specials
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = False) -> str:
        return self.template.render(**self._vars(messages, add_generation_prompt))

    def pieces(self, messages: list[dict], add_generation_prompt: bool = False) -> tuple[list[str], list]:
        """(the template's outputs in order, the [start, end) spans of its generation blocks)."""
        blocks, spans = [], []
        token = _TRACKING.set((blocks, spans))
        try:
            for b in self.template.generate(**self._vars(messages, add_generation_prompt)):
                blocks.append(b)
        finally:
            _TRACKING.reset(token)
        return blocks, spans

    def spans(self, messages: list[dict], where: str) -> ChatText:
        """The conversation's text and its assistant turns' spans (module docstring); ExampleError
        naming `where` when the template fails or the turns cannot be found."""
        try:
            if self.has_generation:
                blocks, spans = self.pieces(messages)
                text = "".join(blocks)
            else:
                text = self.render(messages)
                spans = _Locator(self, messages, text, where).spans()
        except ExampleError:
            raise
        except Exception as e:  # jinja2.TemplateError (raise_exception), UndefinedError, TypeError, ...
            raise ExampleError(
                f"{where}: the chat template fails to render ({type(e).__name__}: {one_line(e, 160)})"
            ) from None
        return ChatText(text, spans, _dropped(messages, text))


class _Locator:
    """The assistant turns of one conversation rendered as `text` (ways 2 and 3 of the module
    docstring)."""

    def __init__(self, renderer: ChatRenderer, messages: list[dict], text: str, where: str):
        self.r, self.messages, self.text, self.where = renderer, messages, text, where
        self._kept = self._text_pieces = None

    def spans(self) -> list[tuple[int, int]]:
        out = []
        for i, m in enumerate(self.messages):
            if m["role"] == "assistant":
                span = self._prefix(self.messages, i) or self._by_pieces(i)
                if out and span[0] < out[-1][1] or span[0] > span[1]:
                    raise self._lost(i)
                out.append(span)
        return out

    def _prefix(self, messages, i):
        before = self.r.render(messages[:i], add_generation_prompt=True)
        upto = self.text if i == len(messages) - 1 and messages is self.messages else self.r.render(messages[: i + 1])
        if self.text.startswith(upto) and upto.startswith(before):
            return len(before), len(upto)
        return None

    def kept(self) -> list[int]:
        """Indices of the messages left once those the template drops whole (rendering the
        conversation without one gives the same text) are left out; assistant turns stay."""
        if self._kept is None:
            self._kept = []
            for j, m in enumerate(self.messages):
                if m["role"] != "assistant":
                    try:
                        if self.r.render(self.messages[:j] + self.messages[j + 1 :]) == self.text:
                            continue
                    except Exception:  # without it the template refuses the chat: it is rendered
                        pass
                self._kept.append(j)
        return self._kept

    def _by_pieces(self, i: int) -> tuple[int, int]:
        msgs, k = self.messages, i
        before = self.r.render(msgs[:k], add_generation_prompt=True)
        if not self.text.startswith(before):  # a message before the turn is not rendered (or not so)
            msgs, k = [self.messages[j] for j in self.kept()], self.kept().index(i)
            if len(msgs) < len(self.messages) and self.r.render(msgs) == self.text:
                span = self._prefix(msgs, k)
                if span:
                    return span
            before = self.r.render(msgs[:k], add_generation_prompt=True)
            if not self.text.startswith(before):
                raise self._lost(i)
        if self._text_pieces is None:
            self._text_pieces = _placed(self.r.pieces(self.messages)[0])
        alone = _placed(self.r.pieces(msgs[: k + 1])[0])  # the turn as the chat's last
        if "".join(p for _, p in alone)[: len(before)] != before:
            raise self._lost(i)
        s = len(before)
        a = next((n for n, (at, p) in enumerate(self._text_pieces) if at + len(p) > s), None)
        b = next((n for n, (at, p) in enumerate(alone) if at + len(p) > s), None)
        if a is None or b is None:
            raise self._lost(i)
        at, p = self._text_pieces[a]
        end = at + len(p)
        for (at, p), (_, q) in zip(self._text_pieces[a + 1 :], alone[b + 1 :]):
            if p != q:
                break
            end = at + len(p)
        return s, end

    def _lost(self, i: int) -> ExampleError:
        return ExampleError(
            f"{self.where}: cannot find assistant turn {i} in the chat template's rendering of the "
            "conversation (add {% generation %} blocks to the template to mark the turns)"
        )


def _placed(pieces: list[str]) -> list[tuple[int, str]]:
    """(start, piece) of each non-empty piece."""
    out, at = [], 0
    for p in pieces:
        if p:
            out.append((at, p))
            at += len(p)
    return out


def _dropped(messages: list[dict], text: str) -> bool:
    """Whether some line of a message's content or reasoning (looked at between markup tags
    such as <think>, and stripped) is missing from `text`."""
    for m in messages:
        for key in ("content", "reasoning_content"):
            value = m.get(key)
            if not isinstance(value, str):
                continue
            for line in value.splitlines():
                for piece in _TAG.split(line):
                    piece = piece.strip()
                    if piece and piece not in text:
                        return True
    return False
