#!/usr/bin/env python
"""Peak RSS and throughput of scripts/prepare.py against corpus size.

    python benchmarks/prepare_stream.py --sizes 100 300 --mode pack --json benchmarks/prepare_stream.json
    python benchmarks/prepare_stream.py --sizes 100 300 --mode text
    python benchmarks/prepare_stream.py --sizes 20 --mode pack --workers 1 2    # processes

Makes a .jsonl corpus of each size (MB) in a scratch directory, then runs
prepare.py on it in a fresh process and reports that process's peak RSS (its
ru_maxrss, read by a wrapper process that runs only it) and MB/s of input.
  pack: chat examples {"messages": [...]} -> --pack ROW_LEN with the golden Llama-2
        chat tokenizer (tests/golden/chat/llama2): render, tokenize, mask, pack
  text: pretraining documents {"text": ...} -> --tokenizer (the same tokenizer), a
        token stream
Flat peak RSS across sizes means memory is bounded by the stream's buffers, not the corpus.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
TOKENIZER = ROOT / "tests" / "golden" / "chat" / "llama2"
WORDS = (
    "the of and to in is for on with as by at from that this it be are was were an or "
    "function value return list string number file data model train token loss batch "
    "device memory shard layer param grad step example answer question"
).split()

_WRAP = (
    "import resource, subprocess, sys, json; rc = subprocess.run(sys.argv[1:]).returncode; "
    "print(json.dumps({'rc': rc, 'maxrss_kb': resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss}))"
)


def make_corpus(path: Path, mb: int, mode: str, seed: int = 0) -> int:
    """A .jsonl of about `mb` MB: a pool of 4096 random lines written round-robin, each
    with its own counter so no two lines are equal."""
    rng = np.random.default_rng(seed)

    def words(lo, hi):
        return " ".join(rng.choice(WORDS, int(rng.integers(lo, hi))))

    pool = []
    for _ in range(4096):
        if mode == "pack":
            pool.append([{"role": "user", "content": words(5, 80)}, {"role": "assistant", "content": words(10, 300)}])
        else:
            pool.append(words(50, 800))
    target, size, i = mb * 10**6, 0, 0
    with open(path, "w") as f:
        while size < target:
            item = pool[i % len(pool)]
            if mode == "pack":
                rec = {"messages": [item[0], {**item[1], "content": f"{i} {item[1]['content']}"}]}
            else:
                rec = {"text": f"{i} {item}"}
            line = json.dumps(rec) + "\n"
            f.write(line)
            size += len(line)
            i += 1
    return size


def measure(
    src: Path, out: Path, mode: str, threads: int | None, row_len: int, root: Path = ROOT, workers: int = 1
) -> dict:
    cmd = [
        sys.executable,
        str(root / "scripts" / "prepare.py"),
        "--out",
        str(out),
        str(src),
        "--tokenizer",
        str(TOKENIZER),
        "--no-progress",
    ]
    if mode == "pack":
        cmd += ["--pack", str(row_len)]
    if threads:
        cmd += ["--threads", str(threads)]
    if workers != 1:
        cmd += ["--workers", str(workers)]
    env = {**os.environ, "PYTHONPATH": str(root)}
    t0 = time.perf_counter()
    res = subprocess.run([sys.executable, "-c", _WRAP, *cmd], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if res.returncode:
        raise SystemExit(f"benchmark: prepare failed: {res.stderr.strip()[-400:]}")
    stats = json.loads(res.stdout.strip().splitlines()[-1])
    if stats["rc"]:
        raise SystemExit(f"benchmark: prepare exited {stats['rc']}: {res.stderr.strip()[-400:]}")
    meta = json.loads((out / "meta.json").read_text())
    return {
        "wall_s": round(wall, 2),
        "peak_rss_mb": round(stats["maxrss_kb"] / 1024, 1),
        "tokens": meta["train_tokens"] + meta["val_tokens"],
        **({"packing_efficiency": meta["packing"]["efficiency"]} if mode == "pack" else {}),
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[100, 300], help="corpus sizes in MB")
    ap.add_argument("--mode", choices=("pack", "text"), default="pack")
    ap.add_argument("--threads", type=int, nargs="+", default=[0], help="--threads values (0 = default)")
    ap.add_argument(
        "--workers",
        type=int,
        nargs="+",
        default=[1],
        help="--pack: --workers values (processes; RSS is then the largest process's)",
    )
    ap.add_argument("--row-len", type=int, default=1024)
    ap.add_argument("--scratch", default=None, help="scratch directory (default: a temp dir)")
    ap.add_argument("--json", help="write the results here")
    ap.add_argument(
        "--root",
        type=Path,
        default=ROOT,
        help="the checkout whose prepare.py runs (e.g. an older release, to compare)",
    )
    args = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(dir=args.scratch) as tmp:
        for mb in args.sizes:
            src = Path(tmp) / f"corpus_{mb}.jsonl"
            nbytes = make_corpus(src, mb, args.mode)
            for th, wk in [(t, w) for t in args.threads for w in args.workers]:
                r = measure(src, Path(tmp) / f"out_{mb}_{th}_{wk}", args.mode, th or None, args.row_len, args.root, wk)
                r = {
                    "mode": args.mode,
                    "input_mb": round(nbytes / 1e6, 1),
                    "threads": th or "default",
                    "workers": wk,
                    **r,
                    "mb_per_s": round(nbytes / 1e6 / r["wall_s"], 2),
                }
                rows.append(r)
                print(json.dumps(r), flush=True)
            src.unlink()
    print("\n| mode | input MB | threads | workers | peak RSS MB | MB/s | wall s | tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['mode']} | {r['input_mb']} | {r['threads']} | {r['workers']} | {r['peak_rss_mb']} | {r['mb_per_s']} | "
            f"{r['wall_s']} | {r['tokens']:,} |"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
