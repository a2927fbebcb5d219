"""The longest trainable sequence against the context axis: Llama-3.1-8B on 8 x H100,
full_shard, one row per fsdp rank, from deviceless XLA:GPU compiles (docs/long_context.md,
BENCHMARKS.md "Longest trainable sequence by context size").

    python benchmarks/longest_context.py                         # every context size (tens of minutes)
    python benchmarks/longest_context.py --contexts 8 --saved DIR   # some; DIR keeps each plan's JSON

For each context size C (fsdp 8 / C, global batch 8 / C: one row per data-parallel rank) the
sequence doubles from --start (default `START`) until the compiled peak no longer fits the
target's memory (or halves until it does); each point is one `fsdp-jax plan --target h100`
run, printed as it comes, then a markdown table (longest that fits, its peak and analytic
estimate, the next length's peak) and the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/llama3_1_8b.yaml"
START = {1: 8192, 2: 32768, 4: 65536, 8: 131072}  # near the longest the analytic model lets fit


def command(context: int, seq: int, target: str) -> list[str]:
    """The `plan` command line of one point."""
    return [
        *(sys.executable, "scripts/plan.py", "--config", CONFIG, "--target", target, "--devices", "8"),
        *("--strategies", "full_shard", "--json"),
        *(f"mesh.context={context}", f"mesh.fsdp={8 // context}", f"train.global_batch={8 // context}"),
        *(f"data.seq_len={seq}", f"model.max_seq_len={max(seq, 131072)}"),
    ]


def point(context: int, seq: int, target: str, saved: Path | None) -> dict:
    """{seq, peak, analytic, fits, compile_s} of one compile (from `saved` when it holds it)."""
    f = None if saved is None else saved / f"c{context}_s{seq}.json"
    if f is not None and f.exists():
        doc = json.loads(f.read_text())
    else:
        env = dict(os.environ, PYTHONPATH=str(ROOT))
        proc = subprocess.run(command(context, seq, target), capture_output=True, text=True, cwd=ROOT, env=env)
        if proc.returncode != 0:
            raise SystemExit(f"context {context}, seq {seq}: plan failed: {proc.stderr.strip().splitlines()[-1:]}")
        doc = json.loads(proc.stdout)
        if f is not None:
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text(proc.stdout)
    r = doc["strategies"]["full_shard"]
    out = {
        "seq": seq,
        "peak": r["compiled"]["peak"],
        "analytic": r["analytic"]["total"],
        "fits": r["fits"],
        "compile_s": r.get("compile_s"),
    }
    print(f"context {context} seq {seq}: {json.dumps(out)}", file=sys.stderr, flush=True)
    return out


def longest(context: int, start: int, target: str, saved: Path | None, refine: int = 0) -> dict:
    """{"context", "fits": the longest fitting point, "next": the first that does not}: powers
    of two from `start`, then `refine` bisection steps between the two."""
    seq, tried = start, {}
    while True:
        tried[seq] = p = point(context, seq, target, saved)
        nxt = seq * 2 if p["fits"] else seq // 2
        if nxt in tried or nxt < 2 * context:
            break
        seq = nxt
    for _ in range(refine):  # bisect between the longest that fits and the first that does not
        ok = [s for s, p in tried.items() if p["fits"]]
        over = [s for s, p in tried.items() if not p["fits"]]
        if not ok or not over:
            break
        mid = (max(ok) + min(over)) // 2 // (2 * context) * (2 * context)  # zig-zag: a multiple of 2C
        if mid in tried:
            break
        tried[mid] = point(context, mid, target, saved)
    ok = [p for p in tried.values() if p["fits"]]
    over = [p for p in tried.values() if not p["fits"]]
    best = max(ok, key=lambda p: p["seq"]) if ok else None
    return {"context": context, "fits": best, "next": min(over, key=lambda p: p["seq"]) if over else None}


def table(rows: list[dict]) -> str:
    gb = lambda b: f"{b / 1e9:.2f} GB"  # noqa: E731
    lines = [
        "| context x fsdp | longest seq that fits | compiled peak / GPU | analytic | shortest tried that does not fit |",
        "|---|---:|---:|---:|---|",
    ]
    for r in rows:
        f, n = r["fits"], r["next"]
        nxt = f"{n['seq']}: {gb(n['peak'])}" if n else "-"
        lines.append(
            f"| {r['context']} x {8 // r['context']} | {f['seq'] if f else 'none'} | {gb(f['peak']) if f else '-'} "
            f"| {gb(f['analytic']) if f else '-'} | {nxt} |"
        )
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--contexts", default="1,2,4,8", help="context sizes (comma list of divisors of 8)")
    ap.add_argument("--start", type=int, default=0, help="first sequence length (default: START[context])")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--refine", type=int, default=0, help="bisection steps after the doubling (default 0)")
    ap.add_argument("--saved", type=Path, help="directory keeping (and reusing) each plan's JSON")
    args = ap.parse_args(argv)
    rows = []
    for c in (int(x) for x in args.contexts.split(",")):
        if c not in (1, 2, 4, 8):
            print(f"error: --contexts: {c} does not divide 8", file=sys.stderr)
            return 2
        rows.append(longest(c, args.start or START[c], args.target, args.saved, args.refine))
    print(table(rows))
    print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
