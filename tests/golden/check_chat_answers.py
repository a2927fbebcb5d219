#!/usr/bin/env python
"""The fine-tuning walk-through's last step (docs/finetuning_data.md), in transformers: the
exported model answers training prompts greedily with the trained answers.

Needs torch + transformers (the golden venv; the project never imports them):

    .venv-golden/bin/python tests/golden/check_chat_answers.py EXPORTED_DIR TOKENIZER_DIR CHATS.jsonl [N]

For the first N (default 24) conversations: the messages before the last (assistant)
one are rendered with `apply_chat_template(add_generation_prompt=True)`, the model
generates 12 tokens greedily, and the answer is compared with the trained one. Exit 0
when every answer starts with the trained answer's first three words.
"""

import json
import sys


def main(hf: str, tokdir: str, chats: str, n: int = 24) -> int:
    import torch
    from transformers import AutoTokenizer, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokdir)
    model = LlamaForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    rows = [json.loads(line) for line in open(chats) if line.strip()][:n]
    start = exact = 0
    for r in rows:
        ids = tok.apply_chat_template(
            r["messages"][:-1], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )["input_ids"]
        out = model.generate(ids, max_new_tokens=12, do_sample=False)
        got = tok.decode(out[0, ids.shape[1] :], skip_special_tokens=True).strip()
        want = r["messages"][-1]["content"]
        start += got.startswith(" ".join(want.split()[:3]))
        exact += got == want
        print(f"{got!r} | trained: {want!r}")
    print(
        f"{start}/{len(rows)} answers start with the trained answer's first 3 words; "
        f"{exact}/{len(rows)} are the trained answer exactly"
    )
    return 0 if start == len(rows) else 1


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4], *(int(x) for x in sys.argv[4:5])))
