"""Fine-tuning examples (fsdp_jax.app.data.examples): chat rendering and tokens against
transformers' apply_chat_template (goldens by tests/golden/make_chat_goldens.py), loss
masks per format, and the byte tokenizer reading the same records."""

import json
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax.app.data.chat_template import ChatRenderer
from fsdp_jax.app.data.examples import ExampleEncoder, find_chat_template, special_tokens
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.errors import ExampleError

CHAT = Path(__file__).resolve().parent / "golden" / "chat"
GOLDENS = json.loads((CHAT / "goldens.json").read_text())


def encoder(name, **kw):
    d = CHAT / name
    return ExampleEncoder(load_tokenizer(d), find_chat_template(d), special_tokens(d), **kw)


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_chat_text_and_tokens_match_transformers(name):
    d = CHAT / name
    renderer = ChatRenderer(find_chat_template(d), special_tokens(d))
    enc = encoder(name)
    for i, row in enumerate(GOLDENS[name]):
        assert renderer.render(row["messages"]) == row["text"], (name, i)
        ex = enc.encode_batch([({"messages": row["messages"]}, f"golden:{i}")])[0]
        assert ex.tokens.tolist() == row["ids"], (name, i)
        if "assistant_masks" in row:  # transformers' own {% generation %} mask
            assert ex.mask.tolist() == row["assistant_masks"], (name, i)


@pytest.mark.parametrize("name", sorted(GOLDENS))
def test_chat_mask_covers_every_assistant_turn_and_nothing_else(name):
    enc, tok = encoder(name), load_tokenizer(CHAT / name)
    for row in GOLDENS[name]:
        ex = enc.encode_batch([({"messages": row["messages"]}, "x:1")])[0]
        trained = tok.decode(ex.tokens[ex.mask == 1])
        for m in row["messages"]:
            if m["role"] == "assistant":
                assert "".join(m["content"].split()) in "".join(trained.split())
            else:
                assert "".join(m["content"].split()) not in "".join(trained.split())
        assert enc.encode_batch([({"messages": row["messages"]}, "x:1")])[0].mask.sum() < len(ex.tokens)


def test_instruction_masks_completion_and_eos_plain_masks_all():
    tok = load_tokenizer(CHAT / "llama2")
    enc = ExampleEncoder(tok)
    ins, plain = enc.encode_batch(
        [({"prompt": "Q: one plus one?\nA:", "completion": " two"}, "f:1"), ({"text": "just text"}, "f:2")]
    )
    assert ins.tokens[-1] == tok.eos_id and ins.mask[-1] == 1
    assert tok.decode(ins.tokens[ins.mask == 1][:-1]).strip() == "two"
    assert ins.mask[:3].sum() == 0
    assert plain.mask.all() and plain.tokens[-1] == tok.eos_id
    every = ExampleEncoder(tok, train_on="all").encode_batch(
        [({"prompt": "Q: one plus one?\nA:", "completion": " two"}, "f:1")]
    )[0]
    assert every.mask.all() and every.tokens.tolist() == ins.tokens.tolist()


def test_byte_tokenizer_reads_the_same_records():
    enc = ExampleEncoder(None, find_chat_template(CHAT / "qwen25"), special_tokens(CHAT / "qwen25"))
    conv = GOLDENS["qwen25"][1]
    ins, plain, chat = enc.encode_batch(
        [
            ({"prompt": "é?", "completion": "ü!"}, "f:1"),
            ({"text": '{"not": json}'}, "f:2"),
            ({"messages": conv["messages"]}, "f:3"),
        ]
    )
    assert bytes(ins.tokens.astype(np.uint8)) == "é?ü!".encode()
    assert bytes(ins.tokens[ins.mask == 1].astype(np.uint8)) == "ü!".encode()
    assert bytes(plain.tokens.astype(np.uint8)) == b'{"not": json}' and plain.mask.all()
    assert bytes(chat.tokens.astype(np.uint8)).decode() == conv["text"]
    trained = bytes(chat.tokens[chat.mask == 1].astype(np.uint8)).decode()
    assert trained == "Paris<|im_end|>\nRome<|im_end|>\n"


@pytest.mark.parametrize(
    "rec, match",
    [
        ({"messages": [{"role": "user"}]}, 'needs a "role" and a "content"'),
        ({"messages": [{"content": "hi"}]}, 'needs a "role" and a "content"'),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "unknown role 'wizard'"),
        ({"messages": []}, "non-empty list"),
        ({"prompt": "only a prompt"}, '"prompt" and "completion" strings'),
        ({"txt": "typo"}, "expected"),
        ([1, 2], "expected a JSON object"),
        (
            {"messages": [{"role": "assistant", "content": "a"}, {"role": "user", "content": "b"}]},
            "fails to render .*roles must alternate",
        ),
    ],
)
def test_bad_records_name_the_place(rec, match):
    with pytest.raises(ExampleError, match=f"^data.jsonl:7: .*{match}"):
        encoder("llama2").encode_batch([(rec, "data.jsonl:7")])


def test_byte_corpus_parses_jsonl_like_a_real_tokenizer(tmp_path):
    from fsdp_jax.app.data import corpus as data

    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps({"text": t}) for t in ["alpha", "béta", "gamma"] * 20) + "\n")
    meta = data.prepare_text([src], tmp_path / "o", val_fraction=0.1)
    stream = np.concatenate([np.fromfile(tmp_path / "o" / f"{s}.bin", meta["dtype"]) for s in ("train", "val")])
    assert bytes(stream.astype(np.uint8)) == ("alpha\nbéta\ngamma\n" * 20).encode()
    assert meta["max_token_id"] == max("alpha\nbéta\ngamma\n".encode())


def test_sentencepiece_masks_by_byte_offsets(tmp_path):
    from test_tokenizer import train_sentencepiece

    tok = load_tokenizer(train_sentencepiece(tmp_path / "sp"))
    ex = ExampleEncoder(tok).encode_batch([({"prompt": "def f(x): café", "completion": " return x"}, "f:1")])[0]
    assert ex.tokens[:-1].tolist() == tok.encode("def f(x): café return x")  # encoded whole
    assert tok.decode(ex.tokens[ex.mask == 1][:-1]) == "return x" and ex.mask[-1] == 1
    assert ex.mask[:-3].sum() == 0
