"""GRPO's prompts: rows {prompt, <columns the rewards read>}, read and tokenized once.

data.path is a .jsonl or .parquet file, a `datasets` directory, or a directory of them
(`fsdp_jax.app.data.examples.read_records`). `grpo.prompt_key` names the prompt: a string
(tokenized as it is, no special tokens added) or a list of chat messages (TRL's conversational
format: rendered by the tokenizer's chat template with the generation prompt, then tokenized).
Every other key of a row is a column passed to the reward functions by name (TRL's `**kwargs`),
e.g. `answer` for `answer_match`; the rewards get the prompt as the row holds it. Without
`grpo.tokenizer` the tokens are the prompt's UTF-8 bytes (a byte-level model, vocab 256) and
completions decode bytes back (invalid UTF-8 replaced). A row whose prompt is longer than
`grpo.max_prompt_len` tokens, empty, or neither a string nor messages is bad input naming file:line.
"""

from __future__ import annotations

import dataclasses
import functools
from pathlib import Path

from fsdp_jax.app.data.chat_template import ChatRenderer, normalize_messages
from fsdp_jax.app.data.examples import find_chat_template, read_records, special_tokens
from fsdp_jax.app.data.tables import KeyMap
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.errors import ConfigError, DataError, ExampleError


@dataclasses.dataclass(frozen=True)
class PromptSet:
    """Prompt rows: `tokens` per row, the prompt `texts`, and the other `columns` by name."""

    tokens: tuple[tuple[int, ...], ...]
    texts: tuple  # the prompts as the rows hold them (strings or message lists)
    columns: dict

    def __len__(self) -> int:
        return len(self.tokens)


class Codec:
    """Text <-> token ids: a tokenizer, or UTF-8 bytes (`path` None)."""

    def __init__(self, path: str | None):
        self.tok = None if path is None else load_tokenizer(path, require_eos=False)
        template = None if path is None else find_chat_template(path)
        self.chat = None if template is None else ChatRenderer(template, special_tokens(path))

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8")) if self.tok is None else self.tok.encode(text)

    def encode_prompt(self, prompt, where: str) -> list[int]:
        """A string as it is, or chat messages rendered with the generation prompt."""
        if isinstance(prompt, str) and prompt:
            return self.encode(prompt)
        if not isinstance(prompt, list) or not prompt:
            raise DataError(f"{where}: the prompt is neither a non-empty string nor a list of messages")
        if self.chat is None:
            raise DataError(f"{where}: a conversational prompt needs grpo.tokenizer with a chat template")
        try:
            return self.encode(self.chat.render(normalize_messages(prompt), add_generation_prompt=True))
        except Exception as e:  # jinja2 errors, bad messages
            raise DataError(f"{where}: the chat template fails to render ({type(e).__name__}: {e})") from None

    def decode(self, ids) -> str:
        ids = [int(i) for i in ids]
        if self.tok is None:
            return bytes(i % 256 for i in ids).decode("utf-8", "replace")
        return self.tok.decode(ids)


def prompt_files(path: str, key: str = "data.path") -> list[Path]:
    p = Path(path)
    if not p.exists():
        raise ConfigError(key, f"{path!r}: no such file or directory (GRPO prompts: .jsonl, .parquet)")
    if p.is_file() or (p / "dataset_info.json").is_file() or (p / "state.json").is_file():
        return [p]
    files = sorted(f for f in p.rglob("*") if f.suffix in (".jsonl", ".parquet"))
    if not files:
        raise ConfigError(key, f"{path!r}: no .jsonl or .parquet files of prompt rows in it")
    return files


def _add(rows: dict, row, where: str, key: str, codec: Codec, max_len: int, vocab: int) -> None:
    if not isinstance(row, dict) or key not in row:
        raise DataError(f"{where}: no {key!r} (grpo.prompt_key) in the row")
    ids = codec.encode_prompt(row[key], where)
    if len(ids) > max_len:
        raise DataError(f"{where}: the prompt has {len(ids)} tokens, longer than grpo.max_prompt_len={max_len}")
    if max(ids) >= vocab:
        raise DataError(f"{where}: token id {max(ids)} is outside model.vocab_size={vocab}")
    n, columns = len(rows["tokens"]), rows["columns"]
    for k, v in row.items():
        if k != key:
            columns.setdefault(k, [None] * n).append(v)
    for col in columns.values():
        if len(col) == n:  # a column this row lacks
            col.append(None)
    rows["tokens"].append(tuple(ids))
    rows["texts"].append(row[key])


@functools.lru_cache(maxsize=2)
def _load(files: tuple, key: str, tokenizer: str | None, max_len: int, vocab: int) -> PromptSet:
    codec = Codec(tokenizer)
    rows: dict = {"tokens": [], "texts": [], "columns": {}}
    for f, _, _ in files:
        try:
            for n, row in read_records(f, KeyMap()):
                _add(rows, row, f"{f}:{n}", key, codec, max_len, vocab)
        except ExampleError as e:
            raise DataError(str(e)) from None
    if not rows["tokens"]:
        raise DataError(f"{', '.join(str(f) for f, _, _ in files)}: no prompt rows")
    return PromptSet(tuple(rows["tokens"]), tuple(rows["texts"]), rows["columns"])


def load_prompts(cfg, eval_set: bool = False) -> PromptSet:
    """The run's prompt rows, or with `eval_set` those of grpo.eval_path (read and tokenized
    once per process; a changed file reloads)."""
    path, key = (cfg.grpo.eval_path, "grpo.eval_path") if eval_set else (cfg.data.path, "data.path")
    files = tuple((f, f.stat().st_mtime_ns, f.stat().st_size) for f in prompt_files(path, key))
    g = cfg.grpo
    return _load(files, g.prompt_key, g.tokenizer, g.max_prompt_len, cfg.model.vocab_size)
