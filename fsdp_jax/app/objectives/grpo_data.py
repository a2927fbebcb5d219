"""GRPO's prompts: a .jsonl of rows {prompt, <columns the rewards read>}, tokenized once.

`grpo.prompt_key` names the prompt (a string); every other key of a row is a column passed to
the reward functions by name (TRL's `**kwargs`), e.g. `answer` for `answer_match`. Without
`grpo.tokenizer` the tokens are the prompt's UTF-8 bytes (a byte-level model, vocab 256) and
completions decode bytes back (invalid UTF-8 replaced). A row whose prompt is longer than
`grpo.max_prompt_len` tokens, empty, or not a string is bad input naming file:line.
"""

from __future__ import annotations

import dataclasses
import functools
import json
from pathlib import Path

from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.errors import ConfigError, DataError


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Prompt rows: `tokens` per row, the prompt `texts`, and the other `columns` by name."""

    tokens: tuple[tuple[int, ...], ...]
    texts: tuple[str, ...]
    columns: dict

    def __len__(self) -> int:
        return len(self.tokens)


class Codec:
    """Text <-> token ids: a tokenizer, or UTF-8 bytes (`path` None)."""

    def __init__(self, path: str | None):
        self.tok = None if path is None else load_tokenizer(path, require_eos=False)

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) if self.tok is None else self.tok.encode(text)

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.tok is None:
            return bytes(i % 256 for i in ids).decode("utf-8", "replace")
        return self.tok.decode(ids)


def prompt_file(path: str) -> Path:
    p = Path(path)
    if not p.is_file() or p.suffix != ".jsonl":
        raise ConfigError("data.path", f"{path!r}: objective grpo reads a .jsonl file of prompt rows")
    return p


def _row(line: str, where: str, key: str) -> dict:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as e:
        raise DataError(f"{where}: not JSON ({e.msg})") from None
    if not isinstance(row, dict):
        raise DataError(f"{where}: a prompt row is a JSON object, got {type(row).__name__}")
    if not isinstance(row.get(key), str) or not row[key]:
        raise DataError(f"{where}: no {key!r} string (grpo.prompt_key)")
    return row


@functools.lru_cache(maxsize=2)
def _load(path: str, mtime: int, key: str, tokenizer: str | None, max_len: int, vocab: int) -> PromptSet:
    codec = Codec(tokenizer)
    tokens, texts, columns = [], [], {}
    with open(path, encoding="utf-8", errors="replace") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{i}"
            row = _row(line, where, key)
            ids = codec.encode(row[key])
            if len(ids) > max_len:
                raise DataError(f"{where}: the prompt has {len(ids)} tokens, longer than grpo.max_prompt_len={max_len}")
            if ids and max(ids) >= vocab:
                raise DataError(f"{where}: token id {max(ids)} is outside model.vocab_size={vocab}")
            n = len(tokens)
            for k, v in row.items():
                if k != key:
                    columns.setdefault(k, [None] * n).append(v)
            for k, col in columns.items():
                if len(col) == n:  # a column this row lacks
                    col.append(None)
            tokens.append(tuple(ids))
            texts.append(row[key])
    if not tokens:
        raise DataError(f"{path}: no prompt rows")
    return PromptSet(tuple(tokens), tuple(texts), columns)


def load_prompts(cfg) -> PromptSet:
    """The run's prompt rows (read and tokenized once per process; a changed file reloads)."""
    p = prompt_file(cfg.data.path)
    g = cfg.grpo
    return _load(str(p), p.stat().st_mtime_ns, g.prompt_key, g.tokenizer, g.max_prompt_len, cfg.model.vocab_size)
