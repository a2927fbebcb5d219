#!/usr/bin/env python
"""Regenerate tests/golden/chat_families/: the published chat templates of five model
families on tiny tokenizers, and what transformers' own `apply_chat_template` makes of
chats as people have them (multi-turn, system prompts, reasoning, OpenAI-style tool
calls with null keys).

Needs transformers + jinja2, which the project never installs: run it with the golden
venv's Python (tests/golden/README.md):

    .venv-golden/bin/python tests/golden/make_chat_family_goldens.py

Inputs, written by hand: `<family>/chat_template.jinja`, each family's template as
published (no hub here, so copied from where it is quoted in public repositories):

  qwen3        Qwen/Qwen3-0.6B tokenizer_config.json (llama.cpp
               models/templates/Qwen-Qwen3-0.6B.jinja)
  llama32      meta-llama/Llama-3.2-3B-Instruct (llama.cpp
               models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja)
  mistral_v03  mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json (as quoted by the
               Berkeley function-calling leaderboard's Mistral handler; indentation
               restored, every tag trims its whitespace so the text is the same)
  phi35        microsoft/Phi-3.5-mini-instruct (llama.cpp
               models/templates/microsoft-Phi-3.5-mini-instruct.jinja)
  gemma3       google/gemma-3-*-it tokenizer_config.json (as quoted by the Berkeley
               function-calling leaderboard's Gemma handler)

Outputs, per family: tokenizer.json (tests/golden/hf/llama_gqa's 256-token BPE with the
family's special tokens added), tokenizer_config.json (bos / eos), `generation.jinja` (the
same template with `{% generation %}` around each assistant turn: what follows the
generation prompt up to the next message, the end-of-turn marker included, and the
template's closing text when the chat ends with that turn; it renders the same text, which
this script checks), and goldens.json: per family, per chat: the messages, transformers'
text and ids with the real template (`tokenize=False` / `tokenize=True`), its
`assistant_masks` with generation.jinja, or the one-line error transformers raised.
Llama 3.2's template prints today's date: the clock is fixed to FIXED_DAY here, and the
tests fix the project's the same way.
"""

from __future__ import annotations

import datetime as dt
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent
OUT = ROOT / "chat_families"
SRC = ROOT / "hf" / "llama_gqa"
FIXED_DAY = dt.datetime(2026, 1, 15, 12, 0, 0)

SOURCES = {
    "qwen3": "Qwen/Qwen3-0.6B tokenizer_config.json chat_template (llama.cpp models/templates/Qwen-Qwen3-0.6B.jinja)",
    "llama32": "meta-llama/Llama-3.2-3B-Instruct chat_template "
    "(llama.cpp models/templates/meta-llama-Llama-3.2-3B-Instruct.jinja)",
    "mistral_v03": "mistralai/Mistral-7B-Instruct-v0.3 tokenizer_config.json chat_template "
    "(quoted by the Berkeley function-calling leaderboard's Mistral handler)",
    "phi35": "microsoft/Phi-3.5-mini-instruct chat_template "
    "(llama.cpp models/templates/microsoft-Phi-3.5-mini-instruct.jinja)",
    "gemma3": "google/gemma-3 *-it tokenizer_config.json chat_template "
    "(quoted by the Berkeley function-calling leaderboard's Gemma handler)",
}

# (old, new) replacements that put {% generation %} around the assistant turns; each `old`
# occurs exactly once.
GENERATION = {
    "qwen3": [
        (
            "{%- if loop.index0 > ns.last_query_index %}",
            "{{- '<|im_start|>' + message.role + '\\n' }}{%- generation %}{%- if loop.index0 > ns.last_query_index %}",
        ),
        ("{{- '<|im_start|>' + message.role + '\\n<think>\\n' +", "{{- '<think>\\n' +"),
        (
            "{%- else %}\n                {{- '<|im_start|>' + message.role + '\\n' + content }}",
            "{%- else %}\n                {{- content }}",
        ),
        (
            "{%- else %}\n            {{- '<|im_start|>' + message.role + '\\n' + content }}",
            "{%- else %}\n            {{- content }}",
        ),
        (
            "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}",
            "{{- '<|im_end|>\\n' }}{%- endgeneration %}\n    {%- elif message.role == \"tool\" %}",
        ),
    ],
    "llama32": [
        (
            "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n'+ message['content'] | trim"
            " + '<|eot_id|>' }}",
            "{{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
            "{%- if message['role'] == 'assistant' %}{%- generation %}{{- message['content'] | trim + '<|eot_id|>' }}"
            "{%- endgeneration %}{%- else %}{{- message['content'] | trim + '<|eot_id|>' }}{%- endif %}",
        ),
        (
            "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}\n",
            "{{- '<|start_header_id|>assistant<|end_header_id|>\\n\\n' -}}{%- generation %}\n",
        ),
        (
            '{{- "}" }}\n        {{- "<|eot_id|>" }}',
            '{{- "}" }}\n        {{- "<|eot_id|>" }}{%- endgeneration %}',
        ),
    ],
    "mistral_v03": [
        (
            '{{- "[TOOL_CALLS] [" }}',
            '{%- generation %}{{- "[TOOL_CALLS] [" }}',
        ),
        (
            '{{- "]" + eos_token }}\n            {%- endif %}\n        {%- endfor %}',
            '{{- "]" + eos_token }}\n            {%- endif %}\n        {%- endfor %}{%- endgeneration %}',
        ),
        (
            '{{- " " + message["content"]|trim + eos_token}}',
            '{%- generation %}{{- " " + message["content"]|trim + eos_token}}{%- endgeneration %}',
        ),
    ],
    "phi35": [
        (
            "{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}",
            "{{'<|assistant|>\n'}}{% generation %}{{message['content'] + '<|end|>\n'}}{% endgeneration %}",
        ),
        (
            "{% else %}{{ eos_token }}{% endif %}",
            "{% else %}{% if messages[-1]['role'] == 'assistant' %}{% generation %}{{ eos_token }}"
            "{% endgeneration %}{% else %}{{ eos_token }}{% endif %}{% endif %}",
        ),
    ],
    "gemma3": [
        (
            "    {%- if message['content'] is string -%}\n        {{ message['content'] | trim }}",
            "    {%- if message['content'] is string and role == 'model' -%}\n"
            "        {%- generation -%}{{ message['content'] | trim }}{{ '<end_of_turn>\\n' }}{%- endgeneration -%}\n"
            "    {%- elif message['content'] is string -%}\n        {{ message['content'] | trim }}",
        ),
        (
            "    {{ '<end_of_turn>\\n' }}\n{%- endfor -%}",
            "    {%- if not (message['content'] is string and role == 'model') -%}{{ '<end_of_turn>\\n' }}"
            "{%- endif -%}\n{%- endfor -%}",
        ),
    ],
}

SPECIALS = {
    "qwen3": dict(
        special=["<|im_start|>", "<|im_end|>"],
        added=["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"],
        bos=None,
        eos="<|im_end|>",
    ),
    "llama32": dict(
        special=["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"],
        bos="<|begin_of_text|>",
        eos="<|eot_id|>",
    ),
    "mistral_v03": dict(
        special=["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]"]
        + ["[/TOOL_RESULTS]"],
        bos="<s>",
        eos="</s>",
    ),
    "phi35": dict(special=["<|system|>", "<|user|>", "<|assistant|>", "<|end|>", "<|endoftext|>"], eos="<|endoftext|>"),
    "gemma3": dict(special=["<bos>", "<start_of_turn>", "<end_of_turn>", "<eos>"], bos="<bos>", eos="<eos>"),
}


def _u(text):
    return {"role": "user", "content": text}


def _a(text, **kw):
    return {"role": "assistant", "content": text, **kw}


SYS = {"role": "system", "content": "You answer in one word."}
MULTI = [_u("Capital of France?"), _a("Paris"), _u("And of Italy?"), _a("Rome")]
CHATS = {
    "single": [_u("What is 2+2?"), _a("4.")],
    "multi": MULTI,
    "system_multi": [SYS, *MULTI],
    "unicode_spaces": [_u("def f(x):\n    return x  # café"), _a("  It returns x.\n"), _u("Thanks"), _a("Welcome!")],
    "null_tool_calls": [_u("Hi"), _a("Hello!", tool_calls=None), _u("Bye"), _a("Goodbye.", tool_calls=None)],
    "reasoning_content": [_u("What is six times seven?"), _a("42", reasoning_content="six times seven")],
    "thinking": [_u("What is six times seven?"), _a("42", thinking="six times seven")],
    "reasoning": [_u("What is six times seven?"), _a("42", reasoning="six times seven")],
    "reasoning_multi": [
        _u("What is six times seven?"),
        _a("42", reasoning_content="six times seven"),
        _u("And minus two?"),
        _a("40", reasoning_content="42 minus 2"),
    ],
    "inline_think": [_u("Two plus two?"), _a("<think>\nadd them\n</think>\n\n4")],
    "tool_call_null_content": [
        _u("Weather in Paris?"),
        _a(
            None,
            tool_calls=[
                {"id": "call12345", "type": "function", "function": {"name": "weather", "arguments": {"city": "Paris"}}}
            ],
        ),
        {"role": "tool", "content": "sunny", "tool_call_id": "call12345"},
        _a("It is sunny.", tool_calls=None),
    ],
}


def make_tokenizer(name: str) -> Path:
    from tokenizers import AddedToken, Tokenizer

    d = OUT / name
    for f in ("tokenizer.json", "tokenizer_config.json", "generation.jinja"):
        (d / f).unlink(missing_ok=True)
    spec = SPECIALS[name]
    tok = Tokenizer.from_file(str(SRC / "tokenizer.json"))
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in spec["special"]])
    if spec.get("added"):
        tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in spec["added"]])
    tok.save(str(d / "tokenizer.json"))
    cfg = {"bos_token": spec.get("bos", "<s>"), "eos_token": spec["eos"], "unk_token": "<unk>"}
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    (d / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    src = (d / "chat_template.jinja").read_text()
    gen = src
    for old, new in GENERATION[name]:
        assert gen.count(old) == 1, (name, old)
        gen = gen.replace(old, new)
    (d / "generation.jinja").write_text(gen)
    return d


def _freeze_clock():
    import transformers.utils.chat_template_utils as ctu

    class Fixed(dt.datetime):
        @classmethod
        def now(cls, tz=None):
            return FIXED_DAY

    ctu.datetime = Fixed


def main() -> None:
    from transformers import AutoTokenizer

    _freeze_clock()
    goldens = {"sources": SOURCES, "fixed_day": FIXED_DAY.isoformat(), "families": {}}
    for name in SPECIALS:
        d = make_tokenizer(name)
        tok = AutoTokenizer.from_pretrained(str(d))
        gen = (d / "generation.jinja").read_text()
        rows = []
        for chat, messages in CHATS.items():
            row = {"chat": chat, "messages": messages}
            try:
                row["text"] = tok.apply_chat_template(messages, tokenize=False)
            except Exception as e:  # the template refuses it (raise_exception, undefined content, ...)
                row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200]}"
                rows.append(row)
                continue
            row["ids"] = list(tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"])
            assert tok.apply_chat_template(messages, tokenize=False, chat_template=gen) == row["text"], (name, chat)
            out = tok.apply_chat_template(
                messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True, chat_template=gen
            )
            assert list(out["input_ids"]) == row["ids"], (name, chat)
            row["assistant_masks"] = list(out["assistant_masks"])
            rows.append(row)
        goldens["families"][name] = rows
        ok = sum("text" in r for r in rows)
        print(f"{d}: {ok} chats rendered, {len(rows) - ok} refused by the template")
    (OUT / "goldens.json").write_text(json.dumps(goldens, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
