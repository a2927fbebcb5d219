"""The CPU GRPO example's toy task: add two numbers (0-9), answer then a newline.

    python examples/grpo_tiny/make_task.py data/grpo_tiny [--sft-lines 4000] [--prompts 1024]

Writes DIR/sft.txt (lines `a+b=c`, the SFT corpus: `fsdp-jax prepare --out DIR/sft DIR/sft.txt`)
and DIR/prompts.jsonl ({"prompt": "a+b=", "answer": "c"} rows, GRPO's prompts), both drawn from
every pair (the SFT is kept short, so the sums are far from learnt when GRPO starts).
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--sft-lines", type=int, default=4000)
    ap.add_argument("--prompts", type=int, default=1024)
    ap.add_argument("--max", type=int, default=9)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    pairs = [(x, y) for x in range(a.max + 1) for y in range(a.max + 1)]
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "sft.txt", "w") as f:
        for _ in range(a.sft_lines):
            x, y = rng.choice(pairs)
            f.write(f"{x}+{y}={x + y}\n")
    with open(out / "prompts.jsonl", "w") as f:
        for _ in range(a.prompts):
            x, y = rng.choice(pairs)
            f.write(json.dumps({"prompt": f"{x}+{y}=", "answer": str(x + y)}) + "\n")
    print(f"wrote {out / 'sft.txt'} ({a.sft_lines} lines) and {out / 'prompts.jsonl'} ({a.prompts} prompts)")


if __name__ == "__main__":
    main()
