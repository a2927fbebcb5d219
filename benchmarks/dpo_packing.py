"""Packed preference pairs against one pair per two padded rows (`preference.packing`), on a
real length distribution: packing efficiency (real tokens / row tokens) and the DPO step's time
per pair on 8 CPU devices.

The pairs: every documented function of the Python standard library this interpreter ships
(`ast`): prompt = its `def` line and docstring, chosen = its body, rejected = the body of the
next documented function in the same file (a wrong answer of a real length); UTF-8 bytes as
tokens (`preference.tokenizer: null`), truncated to `preference.max_length` (keep_start) as
the trainer does, so the lengths are real text's. The efficiency is over all of them; the
step timing takes the first `--pairs` pairs (in file order), packed, and times

- `unpacked`: `train.global_batch` = those pairs, 2 rows each (chosen, rejected);
- `packed`: the same pairs in the fewest rows the packer makes (`train.global_batch` = rows,
  rounded up to the devices with empty rows),

in interleaved rounds (each round a block of both; median over rounds), blocking on each step.
The model reads random ids of the real lengths (vocab 256): the ids do not change the time.

    python benchmarks/dpo_packing.py [--pairs 32] [--rounds 3] [--steps 2] [--json OUT] [key=value ...]

Overrides go to configs/dpo_tiny.yaml (its 2-layer, d_model 64 byte-level decoder; default here:
data.seq_len=512, preference.max_length=256). Pairs whose prompt alone fills max_length are
dropped (the trainer refuses them), counted in the JSON.
"""

import argparse
import ast
import json
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", 8)

from fsdp_jax.app.objectives.preference_data import PairIds, PreferenceReport, collate  # noqa: E402
from fsdp_jax.app.objectives.preference_pack import max_pairs_for, pack_pairs  # noqa: E402
from fsdp_jax.app.planner.abstract_step import build_step  # noqa: E402
from fsdp_jax.app.trainer.setup import load_run_config  # noqa: E402

CONFIG = "configs/dpo_tiny.yaml"
LENGTHS = ["data.seq_len=512", "model.max_seq_len=512", "preference.max_length=256"]


def stdlib_pairs() -> list[PairIds]:
    """(prompt, chosen, rejected) UTF-8 bytes from the standard library's documented functions
    (whole lines: the `def` line through the docstring, then the rest of the body)."""
    out = []
    for f in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        if "test" in f.parts or "tests" in f.parts or "site-packages" in f.parts:
            continue
        try:
            src = f.read_text("utf-8")
            tree = ast.parse(src)
        except (UnicodeDecodeError, SyntaxError, ValueError):
            continue
        lines = src.splitlines(keepends=True)
        fns = []
        for node in ast.walk(tree):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and ast.get_docstring(node)
                and len(node.body) > 1
            ):
                start, cut = node.lineno - 1, node.body[1].lineno - 1
                fns.append(("".join(lines[start:cut]).encode(), "".join(lines[cut : node.end_lineno]).encode()))
        for (p, c), (_, r) in zip(fns, fns[1:]):
            if c and r and c != r:
                out.append(PairIds(list(p), list(c), list(r)))
    return out


def timed_steps(batch, rounds_times: list, steps: int, run: list):
    step, state = run
    t0 = time.perf_counter()
    for _ in range(steps):
        state, m = step(state, batch)
        float(m["loss"])
    rounds_times.append((time.perf_counter() - t0) / steps)
    run[1] = state


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=32, help="pairs per timed step")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    base = LENGTHS + list(args.overrides)
    cfg = load_run_config(CONFIG, base)
    length, cap = cfg.data.seq_len + 1, cfg.preference.max_length or cfg.data.seq_len + 1
    pairs, report = stdlib_pairs(), PreferenceReport()
    found = len(pairs)
    pairs = [p for p in pairs if len(p.prompt) < cap]  # a prompt filling the row: refused by the trainer
    arrays = collate(pairs, length, max_length=cap, truncation=cfg.preference.truncation, report=report)
    every = pack_pairs(arrays, max_pairs_for(cfg.model.max_segments))
    real = int(arrays["attention"].sum())
    lens = arrays["attention"].sum(-1).ravel()
    eff = {
        "pairs": len(pairs),
        "dropped_prompt_fills_row": found - len(pairs),
        "truncated_pairs": report.truncated,
        "sequence_tokens": {
            "median": float(np.median(lens)),
            "mean": float(lens.mean()),
            "p90": float(np.percentile(lens, 90)),
        },
        "unpacked_rows": 2 * len(pairs),
        "unpacked_efficiency": real / (2 * len(pairs) * length),
        "packed_rows": len(every),
        "packed_efficiency": every.stats.efficiency,
        "pairs_per_row": len(pairs) / len(every),
    }
    # the timed pairs: random ids (vocab 256) of the real lengths, both layouts of the same pairs
    sub = {k: v[: args.pairs] for k, v in arrays.items()}
    sub["tokens"] = np.where(sub["attention"] > 0, np.random.default_rng(0).integers(3, 256, sub["tokens"].shape), 0)
    sub["tokens"] = sub["tokens"].astype(np.int32)
    packed = pack_pairs(sub, max_pairs_for(cfg.model.max_segments))
    n = jax.device_count()
    rows = -(-len(packed) // n) * n
    pbatch = packed.rows(np.arange(len(packed)))
    fill = packed.empty_rows(rows - len(packed))
    pbatch = {k: np.concatenate([v, fill[k]]) for k, v in pbatch.items()}
    variants = {
        "unpacked": (load_run_config(CONFIG, base + [f"train.global_batch={args.pairs}"]), sub),
        "packed": (load_run_config(CONFIG, base + ["preference.packing=true", f"train.global_batch={rows}"]), pbatch),
    }
    runs, peaks, batches = {}, {}, {}
    for name, (vcfg, host) in variants.items():
        b = build_step(vcfg)
        peaks[name] = int(b.compile().memory_analysis().peak_memory_in_bytes)
        batches[name] = jax.device_put(host, b.plan.batch)
        runs[name] = [b.step, b.init_state(jax.random.key(0))]
        for _ in range(2):  # warm-up
            timed_steps(batches[name], [], 1, runs[name])
    times = {name: [] for name in variants}
    for _ in range(args.rounds):
        for name in variants:
            timed_steps(batches[name], times[name], args.steps, runs[name])
    res = {}
    for name, (vcfg, _) in variants.items():
        step_s = statistics.median(times[name])
        res[name] = {
            "rows": vcfg.train.global_batch * (1 if name == "packed" else 2),
            "step_s": step_s,
            "pairs_per_s": args.pairs / step_s,
            "peak_bytes": peaks[name],
        }
    res["packed"]["time_per_pair_vs_unpacked"] = res["packed"]["step_s"] / res["unpacked"]["step_s"]
    doc = {
        "command": "python benchmarks/dpo_packing.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": CONFIG,
        "overrides": base,
        "devices": n,
        "device_kind": jax.devices()[0].device_kind,
        "python": sys.version.split()[0],
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "timed_pairs": args.pairs,
        "efficiency": eff,
        "results": res,
    }
    print(
        f"{eff['pairs']} stdlib pairs, sequences median {eff['sequence_tokens']['median']:.0f} / p90 "
        f"{eff['sequence_tokens']['p90']:.0f} bytes, rows of {length}: unpacked efficiency "
        f"{eff['unpacked_efficiency']:.3f} ({eff['unpacked_rows']} rows), packed {eff['packed_efficiency']:.3f} "
        f"({eff['packed_rows']} rows, {eff['pairs_per_row']:.2f} pairs a row)"
    )
    for name, r in res.items():
        print(
            f"{name:9s} {args.pairs} pairs in {r['rows']:4d} rows  step {r['step_s'] * 1e3:8.1f} ms  "
            f"{r['pairs_per_s']:7.1f} pairs/s  peak {r['peak_bytes'] / 2**20:.1f} MiB"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
