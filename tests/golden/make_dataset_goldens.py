#!/usr/bin/env python
"""Regenerate tests/golden/datasets/: tiny Hugging Face `datasets` directories as
`save_to_disk` writes them (Arrow stream files + state.json + dataset_info.json), which
`fsdp-jax prepare` reads as sources with pyarrow alone.

Needs the `datasets` package, which the project never installs; run it with the golden
venv's Python (tests/golden/README.md) after `.venv-golden/bin/pip install datasets`:

    .venv-golden/bin/python tests/golden/make_dataset_goldens.py

Writes:
  chats/        a Dataset of 40 OpenAI-style chats under the column "conversations" (Arrow
                unifies the messages' fields, so a message without tool_calls reads back
                with "tool_calls": null), in 3 Arrow files (num_shards=3)
  qa/           a Dataset of 30 rows {"question", "answer", "id"}
  qa_dict/      a DatasetDict {"train": qa, "test": qa[:5]} (dataset_dict.json + one folder per split)
  records.json  the rows of chats and qa as Python reads them (what prepare must see)
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

OUT = Path(__file__).resolve().parent / "datasets"


def chats() -> list[dict]:
    rows = []
    for i in range(40):
        msgs = [{"role": "user", "content": f"What is {i} plus one?"}]
        if i % 4 == 0:
            call = {"type": "function", "function": {"name": "add", "arguments": json.dumps({"a": i, "b": 1})}}
            msgs += [
                {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": str(i + 1)},
            ]
        msgs.append({"role": "assistant", "content": f"It is {i + 1}."})
        rows.append({"conversations": msgs, "source": "made up"})
    return rows


def qa() -> list[dict]:
    return [{"question": f"Q{i}: twice {i}?", "answer": f" {2 * i}", "id": i} for i in range(30)]


def main() -> None:
    from datasets import Dataset, DatasetDict

    for d in ("chats", "qa", "qa_dict"):
        shutil.rmtree(OUT / d, ignore_errors=True)
    c = Dataset.from_list(chats())
    c.save_to_disk(str(OUT / "chats"), num_shards=3)
    q = Dataset.from_list(qa())
    q.save_to_disk(str(OUT / "qa"))
    DatasetDict({"train": q, "test": q.select(range(5))}).save_to_disk(str(OUT / "qa_dict"))
    records = {"chats": c.to_list(), "qa": q.to_list()}
    (OUT / "records.json").write_text(json.dumps(records, indent=1) + "\n")
    print(f"{OUT}: chats {len(c)} rows, qa {len(q)} rows")


if __name__ == "__main__":
    main()
