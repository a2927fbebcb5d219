"""A small preference set for the CPU DPO example: a prompt naming a word, the chosen answer
spells it backwards, the rejected one repeats it (rows in TRL's standard format).

    python examples/dpo_tiny/make_prefs.py data/dpo_tiny/prefs.jsonl [--rows 512]
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

WORDS = "apple river stone cloud tiger lemon quartz piano maple ocean ember falcon garden violet".split()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--rows", type=int, default=512)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    rng = random.Random(a.seed)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out, "w") as f:
        for _ in range(a.rows):
            w = rng.choice(WORDS) + rng.choice(WORDS)[: rng.randint(0, 3)]
            row = {"prompt": f"reverse {w}: ", "chosen": w[::-1] + "\n", "rejected": w + "\n"}
            f.write(json.dumps(row) + "\n")
    print(f"wrote {a.rows} pairs to {out}")


if __name__ == "__main__":
    main()
