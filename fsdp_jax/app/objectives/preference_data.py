"""Preference data: {prompt, chosen, rejected} rows -> token pairs, as TRL's DPOTrainer makes them.

Rows come from .jsonl, .parquet or `datasets` directories (`fsdp_jax.app.data.examples.read_records`),
key names mappable (`PreferenceKeys`). Two formats, TRL's:

- standard: `prompt`, `chosen`, `rejected` strings. The tokenizer's EOS text is appended to a
  completion that lacks it; prompt and prompt + completion are tokenized as the tokenizer's
  `__call__` does (its post-processor's special tokens included, a BOS for Llama's).
- conversational: `chosen` / `rejected` lists of messages, `prompt` a list too (TRL's
  explicit prompt) or absent or a string (UltraFeedback-binarized: `chosen` / `rejected`
  repeat the prompt turns; the prompt is then their longest common message prefix, TRL's
  `extract_prompt`). Rendered with the model's chat template (`fsdp_jax.app.data.chat_template`):
  prompt with the generation prompt, prompt + chosen and prompt + rejected without; the
  completion's ids are what follows the prompt's ids (a mismatch is counted, as TRL warns).

Truncation (TRL 1.x `DataCollatorForPreference`): prompt + completion longer than
`max_length` keeps its first (`keep_start`) or last (`keep_end`) `max_length` tokens; counted
in the report. Bad input raises DataError naming the file and line: a row without `chosen` or
`rejected`, an empty completion, a prompt that fills the whole row under keep_start (TRL would
drop it silently). Identical chosen and rejected warn and are counted.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from fsdp_jax.app.data.chat_template import ChatRenderer, normalize_messages
from fsdp_jax.app.data.examples import read_records
from fsdp_jax.app.data.tables import KeyMap
from fsdp_jax.errors import DataError, ExampleError

TRUNCATION = ("keep_start", "keep_end")


@dataclasses.dataclass(frozen=True)
class PreferenceKeys:
    """Source key for each record key (e.g. `question` -> prompt)."""

    prompt: str = "prompt"
    chosen: str = "chosen"
    rejected: str = "rejected"

    def apply(self, rec: Any) -> Any:
        if not isinstance(rec, dict) or self == PreferenceKeys():
            return rec
        return {k: rec[src] for k, src in dataclasses.asdict(self).items() if src in rec}


@dataclasses.dataclass
class PreferenceReport:
    pairs: int = 0
    truncated: int = 0  # pairs with a row cut to max_length
    identical: int = 0  # chosen == rejected (kept; they carry no signal)
    prefix_mismatch: int = 0  # prompt ids not a prefix of prompt + completion ids
    conversational: int = 0
    max_row: int = 0  # longest prompt + completion before truncation

    def lines(self) -> list[str]:
        return [
            f"{self.pairs} pairs ({self.conversational} conversational), longest row {self.max_row} tokens",
            f"truncated {self.truncated}, identical chosen/rejected {self.identical}, "
            f"prompt/completion boundary mismatches {self.prefix_mismatch}",
        ]


@dataclasses.dataclass(frozen=True)
class PairIds:
    prompt: list[int]
    chosen: list[int]
    rejected: list[int]


class PairEncoder:
    """Rows -> `PairIds` for one tokenizer (`fsdp_jax.app.data.tokenizer.Tokenizer`; None =
    UTF-8 bytes), chat template (None: conversational rows refused) and special tokens."""

    def __init__(self, tok=None, chat_template: str | None = None, specials: dict | None = None):
        self.tok = tok
        self.specials = specials or {}
        self.eos_text = self.specials.get("eos_token")
        self.chat = None if chat_template is None else ChatRenderer(chat_template, self.specials)

    def _ids(self, text: str, special: bool) -> list[int]:
        if self.tok is None:
            return list(text.encode("utf-8"))
        if self.tok.kind == "hf":
            return list(self.tok._tok.encode(text, add_special_tokens=special).ids)
        return self.tok.encode(text)

    def encode(self, rec: Any, where: str, report: PreferenceReport) -> PairIds:
        if not isinstance(rec, dict):
            raise ExampleError(f'{where}: expected a JSON object with "prompt", "chosen" and "rejected"')
        for k in ("chosen", "rejected"):
            if k not in rec or rec[k] is None:
                raise ExampleError(f'{where}: no "{k}" (a preference row needs "chosen" and "rejected")')
        if isinstance(rec["chosen"], list):
            report.conversational += 1
            pair = self._chat(rec, where, report)
        else:
            pair = self._standard(rec, where, report)
        for k in ("chosen", "rejected"):
            if not getattr(pair, k):
                raise ExampleError(f"{where}: the {k} completion is empty")
        if pair.chosen == pair.rejected:
            report.identical += 1
        return pair

    def _standard(self, rec, where, report) -> PairIds:
        prompt = rec.get("prompt", "")
        if not all(isinstance(rec[k], str) for k in ("chosen", "rejected")) or not isinstance(prompt, str):
            raise ExampleError(f'{where}: "prompt", "chosen" and "rejected" must all be strings or all messages')
        p = self._ids(prompt, True)
        out = []
        for k in ("chosen", "rejected"):
            c = rec[k]
            if self.eos_text and not c.endswith(self.eos_text):
                c += self.eos_text
            full = self._ids(prompt + c, True)
            report.prefix_mismatch += full[: len(p)] != p
            out.append(full[len(p) :])
        return PairIds(p, *out)

    def _chat(self, rec, where, report) -> PairIds:
        chosen, rejected = rec["chosen"], rec["rejected"]
        if not isinstance(rejected, list):
            raise ExampleError(f'{where}: "chosen" is a list of messages but "rejected" is not')
        if self.chat is None:
            raise ExampleError(f"{where}: a conversational row needs a chat template (the tokenizer has none)")
        prompt = rec.get("prompt")
        if not isinstance(prompt, list):  # implicit prompt (UltraFeedback-binarized repeats it)
            n = 0
            while n < min(len(chosen), len(rejected)) - 1 and chosen[n] == rejected[n]:
                n += 1
            prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
        try:
            p_text = self.chat.render(normalize_messages(prompt), add_generation_prompt=True)
            texts = [self.chat.render(normalize_messages(prompt + c)) for c in (chosen, rejected)]
        except Exception as e:  # jinja2 errors, bad messages
            raise ExampleError(f"{where}: the chat template fails to render ({type(e).__name__}: {e})") from None
        p = self._ids(p_text, False)
        out = []
        for t in texts:
            full = self._ids(t, False)
            report.prefix_mismatch += full[: len(p)] != p
            out.append(full[len(p) :])
        return PairIds(p, *out)


def read_pairs(
    files: Iterable[str | Path], encoder: PairEncoder, keys: PreferenceKeys = PreferenceKeys()
) -> tuple[list[PairIds], list[str], PreferenceReport]:
    """Every row of `files` as `PairIds`, with its "file:line" and the report."""
    pairs, wheres, report = [], [], PreferenceReport()
    for f in files:
        f = Path(f)
        if not f.exists():
            raise DataError(f"preference data {f}: no such file or directory")
        try:
            for n, rec in read_records(f, KeyMap()):
                where = f"{f}:{n}"
                pairs.append(encoder.encode(keys.apply(rec), where, report))
                wheres.append(where)
        except ExampleError as e:
            raise DataError(str(e)) from None
    report.pairs = len(pairs)
    if not pairs:
        raise DataError(f"preference data {', '.join(map(str, files))}: no rows")
    return pairs, wheres, report


def collate(
    pairs: list[PairIds],
    length: int,
    *,
    max_length: int | None = None,
    truncation: str = "keep_start",
    pad_id: int = 0,
    wheres: list[str] | None = None,
    report: PreferenceReport | None = None,
) -> dict[str, np.ndarray]:
    """Pairs -> {tokens int32, completion uint8, attention uint8} of shape (P, 2, length):
    prompt + completion, truncated to `max_length` (default `length`) as TRL's collator does,
    right-padded with `pad_id` (TRL's row layout, one pair per leading index)."""
    if truncation not in TRUNCATION:
        raise DataError(f"preference.truncation {truncation!r}: allowed {', '.join(TRUNCATION)}")
    cap = min(length, max_length or length)
    p = len(pairs)
    tokens = np.full((p, 2, length), pad_id, np.int32)
    completion = np.zeros((p, 2, length), np.uint8)
    attention = np.zeros((p, 2, length), np.uint8)
    for i, pair in enumerate(pairs):
        if truncation == "keep_start" and len(pair.prompt) >= cap:
            where = wheres[i] if wheres else f"pair {i}"
            raise DataError(
                f"{where}: the prompt ({len(pair.prompt)} tokens) fills the whole row (max_length {cap}); "
                "raise preference.max_length or shorten the prompt"
            )
        cut = False
        for j, comp in enumerate((pair.chosen, pair.rejected)):
            ids = pair.prompt + comp
            mask = [0] * len(pair.prompt) + [1] * len(comp)
            if report is not None:
                report.max_row = max(report.max_row, len(ids))
            if len(ids) > cap:
                cut = True
                sl = slice(None, cap) if truncation == "keep_start" else slice(-cap, None)
                ids, mask = ids[sl], mask[sl]
            tokens[i, j, : len(ids)] = ids
            completion[i, j, : len(ids)] = mask
            attention[i, j, : len(ids)] = 1
        if cut and report is not None:
            report.truncated += 1
    return {"tokens": tokens, "completion": completion, "attention": attention}
