"""GRPO's prompt rows (objectives/grpo_data.py): .jsonl, .parquet and directories of them,
columns for the rewards, conversational prompts through the tokenizer's chat template, and
bad rows named by file:line."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from fsdp_jax.app.data.chat_template import ChatRenderer
from fsdp_jax.app.data.examples import find_chat_template, special_tokens
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.app.objectives.grpo_data import load_prompts
from fsdp_jax.errors import DataError
from helpers import ROOT

QWEN = ROOT / "tests" / "golden" / "chat" / "qwen25"


def cfg(path, tokenizer=None, max_len=64, vocab=256):
    return SimpleNamespace(
        data=SimpleNamespace(path=str(path)),
        grpo=SimpleNamespace(prompt_key="prompt", tokenizer=tokenizer, max_prompt_len=max_len),
        model=SimpleNamespace(vocab_size=vocab),
    )


def test_jsonl_and_parquet_rows_with_columns(tmp_path):
    d = tmp_path / "prompts"
    d.mkdir()
    (d / "a.jsonl").write_text(json.dumps({"prompt": "1+2=", "answer": "3"}) + "\n\n")
    pq.write_table(pa.table({"prompt": ["2+2=", "9+0="], "answer": ["4", "9"], "level": [1, 2]}), d / "b.parquet")
    got = load_prompts(cfg(d))
    assert got.tokens == (tuple(b"1+2="), tuple(b"2+2="), tuple(b"9+0="))
    assert got.texts == ("1+2=", "2+2=", "9+0=")
    assert got.columns == {"answer": ["3", "4", "9"], "level": [None, 1, 2]}


def test_conversational_prompts_use_the_chat_template(tmp_path):
    msgs = [{"role": "system", "content": "Add."}, {"role": "user", "content": "2+2="}]
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"prompt": msgs, "answer": "4"}) + "\n")
    got = load_prompts(cfg(f, str(QWEN), max_len=256, vocab=1000))
    text = ChatRenderer(find_chat_template(QWEN), special_tokens(QWEN)).render(msgs, add_generation_prompt=True)
    assert "2+2=" in text and text.endswith("assistant\n")
    assert got.tokens[0] == tuple(load_tokenizer(QWEN, require_eos=False).encode(text))
    assert got.texts[0] == msgs  # the rewards get the messages


@pytest.mark.parametrize(
    "line, words",
    [
        ({"question": "1+2="}, ["p.jsonl:1", "no 'prompt'"]),
        ({"prompt": ""}, ["p.jsonl:1", "neither a non-empty string"]),
        ({"prompt": [{"role": "user", "content": "hi"}]}, ["p.jsonl:1", "needs grpo.tokenizer with a chat template"]),
        ({"prompt": "x" * 65}, ["p.jsonl:1", "65 tokens", "grpo.max_prompt_len=64"]),
    ],
)
def test_bad_rows_are_named(tmp_path, line, words):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps(line) + "\n")
    with pytest.raises(DataError) as e:
        load_prompts(cfg(f))
    assert all(w in str(e.value) for w in words), str(e.value)


def test_not_json_and_empty_files_are_named(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("{not json\n")
    with pytest.raises(DataError, match="p.jsonl:1: not JSON"):
        load_prompts(cfg(f))
    f.write_text("\n")
    with pytest.raises(DataError, match="no prompt rows"):
        load_prompts(cfg(f))
