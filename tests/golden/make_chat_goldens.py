#!/usr/bin/env python
"""Regenerate tests/golden/chat/: tiny tokenizers carrying real chat templates, and what
transformers' own `apply_chat_template` makes of a few conversations.

Needs transformers + jinja2, which the project never installs; use the golden venv:

    .venv-golden/bin/python tests/golden/make_chat_goldens.py

Each tokenizer is tests/golden/hf/llama_gqa's 256-token BPE copied, with a template:
  llama2   Llama-2's [INST] template (system prompt folded into the first user turn,
           raise_exception on roles out of order) in tokenizer_config.json; no new tokens
           (so the golden model can be fine-tuned with it)
  llama3   Llama-3's header template in tokenizer_config.json, with its special tokens added
  qwen25   Qwen2.5's ChatML template (default system prompt) in chat_template.jinja, with
           <|im_start|>/<|im_end|> added, and {% generation %} around assistant turns so
           transformers also returns its own assistant-token mask
goldens.json: per tokenizer, per conversation: the messages, the rendered text
(`tokenize=False`), the token ids (`tokenize=True`) and, for qwen25, transformers'
`assistant_masks`.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "chat"
SRC = ROOT / "hf" / "llama_gqa"

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}"
)

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are Qwen, created by Alibaba Cloud. You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if message.role == "user" or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- generation %}
        {{- message.content + '<|im_end|>\\n' }}
        {%- endgeneration %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""

CONVERSATIONS = [
    [{"role": "user", "content": "What is 2+2?"}, {"role": "assistant", "content": "4."}],
    [
        {"role": "system", "content": "You answer in one word."},
        {"role": "user", "content": "Capital of France?"},
        {"role": "assistant", "content": "Paris"},
        {"role": "user", "content": "And of Italy?"},
        {"role": "assistant", "content": "Rome"},
    ],
    [
        {"role": "user", "content": "def f(x):\n    return x  # café ünïcode"},
        {"role": "assistant", "content": "  It returns x unchanged.\n"},
        {"role": "user", "content": "Thanks"},
        {"role": "assistant", "content": "You're welcome!"},
    ],
]

SPECS = {
    "llama2": dict(template=LLAMA2, where="config", added=[]),
    "llama3": dict(
        template=LLAMA3,
        where="config",
        added=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "qwen25": dict(template=QWEN25, where="jinja", added=["<|im_start|>", "<|im_end|>"], eos="<|im_end|>"),
}


def make_tokenizer(name: str, spec: dict) -> Path:
    from tokenizers import AddedToken, Tokenizer

    d = OUT / name
    if d.exists():
        shutil.rmtree(d)
    d.mkdir(parents=True)
    tok = Tokenizer.from_file(str(SRC / "tokenizer.json"))
    if spec["added"]:
        tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["added"]])
    tok.save(str(d / "tokenizer.json"))
    cfg = {
        "bos_token": spec.get("bos", "<s>"),
        "eos_token": spec.get("eos", "</s>"),
        "unk_token": "<unk>",
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    if spec["where"] == "config":
        cfg["chat_template"] = spec["template"]
    else:
        (d / "chat_template.jinja").write_text(spec["template"])
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    return d


def main() -> None:
    from transformers import AutoTokenizer

    goldens = {}
    for name, spec in SPECS.items():
        d = make_tokenizer(name, spec)
        tok = AutoTokenizer.from_pretrained(str(d))
        rows = []
        for conv in CONVERSATIONS:
            row = {"messages": conv, "text": tok.apply_chat_template(conv, tokenize=False)}
            if name == "qwen25":
                out = tok.apply_chat_template(conv, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
                row["ids"], row["assistant_masks"] = list(out["input_ids"]), list(out["assistant_masks"])
            else:
                out = tok.apply_chat_template(conv, tokenize=True, return_dict=True)
                row["ids"] = list(out["input_ids"])
            rows.append(row)
        goldens[name] = rows
        print(f"{d}: {len(rows)} conversations, first text {rows[0]['text']!r}")
    (OUT / "goldens.json").write_text(json.dumps(goldens, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
