"""Chats as people have them under the published templates of Qwen3, Llama 3.2, Mistral v0.3,
Phi-3.5 and Gemma 3 (tests/golden/chat_families/, made by make_chat_family_goldens.py with
transformers 5.24): the project's text and ids equal `apply_chat_template`'s, and its loss
mask, found on the real template, equals transformers' `return_assistant_tokens_mask` on the
same template with `{% generation %}` around the assistant turns (generation.jinja)."""

import json
from datetime import datetime
from pathlib import Path

import pytest

from fsdp_jax.app.data import chat_template
from fsdp_jax.app.data.examples import ExampleEncoder, find_chat_template, special_tokens
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.errors import ExampleError

ROOT = Path(__file__).resolve().parent / "golden" / "chat_families"
GOLDENS = json.loads((ROOT / "goldens.json").read_text())
ROWS = [(fam, row) for fam, rows in GOLDENS["families"].items() for row in rows]


@pytest.fixture(autouse=True)
def fixed_clock(monkeypatch):  # Llama 3.2's template prints today's date
    day = datetime.fromisoformat(GOLDENS["fixed_day"])
    monkeypatch.setattr(chat_template, "_now", lambda: day)


def encoder(fam, template=None):
    d = ROOT / fam
    return ExampleEncoder(load_tokenizer(d), template or find_chat_template(d), special_tokens(d))


def encode(fam, messages, template=None):
    return encoder(fam, template).encode_batch([({"messages": messages}, "chats.jsonl:3")])[0]


@pytest.mark.parametrize("fam, row", ROWS, ids=[f"{f}-{r['chat']}" for f, r in ROWS])
def test_text_ids_and_mask_equal_transformers(fam, row):
    if "error" in row:  # transformers refuses it too: one line naming the place
        with pytest.raises(ExampleError, match=r"^chats.jsonl:3: the chat template fails to render") as e:
            encode(fam, row["messages"])
        assert "\n" not in str(e.value) and row["error"].split(":")[0] in str(e.value)
        return
    d = ROOT / fam
    renderer = chat_template.ChatRenderer(find_chat_template(d), special_tokens(d))
    assert renderer.render(chat_template.normalize_messages(row["messages"])) == row["text"]
    ex = encode(fam, row["messages"])
    assert ex.tokens.tolist() == row["ids"]
    assert ex.mask.tolist() == row["assistant_masks"]
    marked = encode(fam, row["messages"], (d / "generation.jinja").read_text())  # transformers' own way
    assert marked.tokens.tolist() == row["ids"] and marked.mask.tolist() == row["assistant_masks"]


def trained_text(fam, ex):
    return load_tokenizer(ROOT / fam).decode(ex.tokens[ex.mask == 1])


@pytest.mark.parametrize("key", ["reasoning_content", "thinking", "reasoning"])
def test_reasoning_under_any_name_is_trained_with_qwen3(key):
    msgs = [{"role": "user", "content": "What is six times seven?"}, {"role": "assistant", "content": "42", key: "six"}]
    trained = trained_text("qwen3", encode("qwen3", msgs))
    assert "<think>\nsix\n</think>\n\n42<|im_end|>" in trained.replace("▁", " ").replace(" ", "")


def test_null_keys_are_dropped_as_transformers_drops_them():
    msgs = [
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": "Hello!", "tool_calls": None, "reasoning_content": None},
    ]
    assert (
        encode("llama32", msgs).tokens.tolist()
        == encode("llama32", chat_template.normalize_messages(msgs)).tokens.tolist()
    )
    call = {"function": {"name": "weather", "arguments": {"city": "Paris"}}}
    ex = encode("llama32", [msgs[0], {"role": "assistant", "content": None, "tool_calls": [call]}])
    assert '"parameters": {"city": "Paris"}' in trained_text("llama32", ex).replace("▁", " ")


U, A = {"role": "user", "content": "Six times seven?"}, {"role": "assistant", "content": "42"}
SYSTEM = {"role": "system", "content": "Answer in digits."}


@pytest.mark.parametrize(
    "fam, messages, dropped",
    [
        ("mistral_v03", [SYSTEM, U, A], True),  # renders the system prompt only before a final user turn
        ("mistral_v03", [U, A, U, A], False),
        ("qwen3", [U, {**A, "reasoning_content": "multiply"}, U, {**A, "reasoning_content": "again"}], True),
        ("qwen3", [SYSTEM, U, A, U, A], False),
        ("gemma3", [U, {**A, "thinking": "multiply"}], True),  # renders no reasoning at all
        ("llama32", [SYSTEM, U, A], False),
    ],
    ids=["mistral-system", "mistral", "qwen3-earlier-reasoning", "qwen3", "gemma3-reasoning", "llama32"],
)
def test_text_the_template_leaves_out_is_flagged(fam, messages, dropped):
    assert encode(fam, messages).dropped is dropped


@pytest.mark.parametrize(
    "messages, match",
    [
        (
            [{"role": "assistant", "content": None}],
            r'message 0 needs a "role" and a "content" string \(or "tool_calls"\)',
        ),
        ([{"role": "user", "content": 5}], 'message 0 needs a "role" and a "content" string'),
        ([{"role": "user", "content": "a", "reasoning_content": 3}], "message 0's reasoning must be a string"),
        ([{"role": None, "content": "a"}], 'message 0 needs a "role"'),
    ],
)
def test_bad_messages_are_one_line(messages, match):
    with pytest.raises(ExampleError, match=f"^chats.jsonl:3: {match}"):
        encode("qwen3", messages)


def test_a_template_whose_turns_cannot_be_found_is_one_line():
    # the assistant's text is rendered before the user's: no generation prompt precedes it
    src = "{% for m in messages|reverse %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
    with pytest.raises(ExampleError, match=r"^chats.jsonl:3: cannot find assistant turn 1 .*generation"):
        ExampleEncoder(None, src).encode_batch(
            [({"messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]}, "chats.jsonl:3")]
        )


def test_prepare_says_how_many_chats_lose_text_to_the_template(tmp_path, capsys):
    from helpers import call

    rows = [[SYSTEM, U, A]] * 30 + [[U, A, U, {**A, "content": "41"}]] * 10  # Mistral v0.3 drops SYSTEM
    src = tmp_path / "chats.jsonl"
    src.write_text("".join(json.dumps({"messages": m}) + "\n" for m in rows))
    out = tmp_path / "sft"
    args = [str(src), "--out", str(out), "--pack", "64", "--tokenizer", str(ROOT / "mistral_v03"), "--no-progress"]
    code, stdout, stderr = call("prepare", *args, capsys=capsys)
    assert code == 0, stderr
    (warning,) = [ln for ln in stderr.splitlines() if ln.startswith("warning:")]
    assert warning.startswith(
        f"warning: 30 of 40 chat examples have message text their chat template does not render (first: {src}:1;"
    )
    meta = json.loads((out / "meta.json").read_text())
    assert meta["template_dropped"] == 30 and meta["first_template_dropped"] == f"{src}:1"
