"""Built-in reward functions, TRL's signature: `fn(prompts, completions, **columns) -> list[float]`.

Pure Python (no project imports): the reward worker (`reward_worker.py`) loads this file in a
process of its own without importing jax. Named in a run's `grpo.rewards` by their short
names (`answer_match`, `format`), with their arguments:

    rewards:
      - {fn: answer_match, weight: 1.0}                      # the prompt row's `answer` column
      - {fn: format, weight: 0.2, args: {pattern: '^\\d+$'}}  # regex over the stripped completion
"""

from __future__ import annotations

import re


def _text(c) -> str:
    """A completion as text: a string, or a chat completion's last message content."""
    if isinstance(c, list) and c and isinstance(c[-1], dict):
        return str(c[-1].get("content", ""))
    return str(c)


def answer_match(prompts, completions, answer=None, column: str = "answer", strip: str = "", **columns):
    """1.0 where the completion (whitespace and the characters in `strip` removed at both ends)
    equals the row's answer (the `column` column, as a string), else 0.0; None where the row
    has no answer (not scored)."""
    answers = answer if column == "answer" else columns.get(column)
    if answers is None:
        return [None] * len(completions)
    out = []
    for c, a in zip(completions, answers):
        if a is None:
            out.append(None)
            continue
        got = _text(c).strip().strip(strip).strip()
        out.append(1.0 if got == str(a).strip() else 0.0)
    return out


def format_match(prompts, completions, pattern: str = r"^.+$", full: bool = True, **columns):
    """1.0 where the stripped completion matches the regex `pattern` (`full`: the whole of it,
    else anywhere), else 0.0."""
    rx = re.compile(pattern, re.DOTALL)
    find = rx.fullmatch if full else rx.search
    return [1.0 if find(_text(c).strip()) else 0.0 for c in completions]


BUILTINS = {"answer_match": answer_match, "format": format_match}
