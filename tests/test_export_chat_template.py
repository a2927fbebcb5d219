"""`export --hf` ships the chat template (transformers 5 keeps it only in chat_template.jinja):
the one of the model a run was imported from, or the one a packed corpus' chats were rendered
with (the corpus keeps its own copy)."""

import json
import shutil
from pathlib import Path

import jax
import pytest

from fsdp_jax.app.config import config_to_dict, load_config
from fsdp_jax.app.data.sft import prepare_examples
from fsdp_jax.app.hf.export import export_hf
from fsdp_jax.app.models import Decoder
from fsdp_jax.checkpoint import Checkpointer
from fsdp_jax.model.fns import from_nnx

GOLDEN = Path(__file__).resolve().parent / "golden"
QWEN25 = GOLDEN / "chat" / "qwen25"  # a tokenizer with chat_template.jinja beside it


def chats(tmp_path) -> Path:
    src = tmp_path / "chats.jsonl"
    chat = {"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello there"}]}
    src.write_text((json.dumps(chat) + "\n") * 40)
    return src


def export_run(tmp_path, yml_text: str) -> Path:
    yml = tmp_path / "c.yaml"
    yml.write_text(yml_text)
    cfg = load_config(yml)
    init = from_nnx(lambda r: Decoder(cfg.model, rngs=r)).init
    params = jax.jit(init)(jax.random.key(0))  # one compile, not one per op of an eager init
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(1, {"params": params}, {"config": config_to_dict(cfg)})
    export_hf(tmp_path / "ck", tmp_path / "out")
    return tmp_path / "out"


MODEL = "model: {vocab_size: 258, d_model: 32, n_layers: 1, n_heads: 2, n_kv_heads: 2, ffn_dim: 64, max_seq_len: 32}\n"


@pytest.mark.slow
def test_export_of_a_chat_fine_tune_ships_the_template_its_chats_were_rendered_with(tmp_path):
    tok = tmp_path / "tok"
    shutil.copytree(QWEN25, tok)
    meta = prepare_examples([chats(tmp_path)], tmp_path / "sft", row_len=128, val_fraction=0.2, tokenizer=str(tok))
    assert meta["chat_template"] == "chat_template.jinja"
    (tok / "chat_template.jinja").write_text("{{ 'edited after the corpus was prepared' }}")
    out = export_run(tmp_path, MODEL + f"data: {{seq_len: 32, path: {tmp_path / 'sft'}}}\n")
    assert (out / "chat_template.jinja").read_text() == (QWEN25 / "chat_template.jinja").read_text()
    assert (out / "tokenizer.json").read_bytes() == (QWEN25 / "tokenizer.json").read_bytes()


def test_an_explicit_chat_template_is_the_one_exported(tmp_path):
    tpl = tmp_path / "mine.jinja"
    tpl.write_text("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}")
    prepare_examples(
        [chats(tmp_path)],
        tmp_path / "sft",
        row_len=128,
        val_fraction=0.2,
        tokenizer=str(QWEN25),
        chat_template=str(tpl),
    )
    assert (tmp_path / "sft" / "chat_template.jinja").read_text() == tpl.read_text()
    out = export_run(tmp_path, MODEL + f"data: {{seq_len: 32, path: {tmp_path / 'sft'}}}\n")
    assert (out / "chat_template.jinja").read_text() == tpl.read_text()


def test_export_of_an_imported_model_ships_its_chat_template(tmp_path):
    src = tmp_path / "hf"
    shutil.copytree(GOLDEN / "hf" / "llama_tied", src)
    (src / "chat_template.jinja").write_text("{{ messages[0].content }}")
    out = export_run(tmp_path, f"init_from: hf:{src}\ndata: {{seq_len: 32, path: {tmp_path / 'd'}}}\n")
    assert (out / "chat_template.jinja").read_text() == "{{ messages[0].content }}"
