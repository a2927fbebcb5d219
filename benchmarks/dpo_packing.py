"""Packed preference pairs against one pair per two padded rows (`preference.packing`), on a
real length distribution: packing efficiency (real tokens / row tokens) and the DPO step's time
per pair on 8 CPU devices.

The pairs: every documented function of the Python standard library this interpreter ships
(`ast`): prompt = its `def` line and docstring, chosen = its body, rejected = the body of the
next documented function in the same file (a wrong answer of a real length); UTF-8 bytes as
tokens (`preference.tokenizer: null`), so the lengths are real text's. For each sequence cap C
(`--caps`; keep_start truncation, as the trainer's `preference.max_length`) it reports the
efficiency (real tokens / row tokens) of the unpacked layout at its tightest, rows of C
(`data.seq_len` = C - 1), against the pairs packed into rows of 2C (`data.seq_len` = 2C - 1,
`preference.max_length` = C: any pair fits). The step timing (`--cap`) takes the first `--pairs`
pairs (file order) and times the DPO step (reference in model state, 8 CPU devices, full_shard)

- `unpacked`: `train.global_batch` = those pairs, 2 rows of C each;
- `packed`: the same pairs in the rows of 2C the packer makes (`train.global_batch` = rows,
  rounded up to the devices with empty rows),

in interleaved rounds (each round a block of both; median over rounds), blocking on each step.
The model reads random ids of the real lengths (vocab 256): the ids do not change the time.

    python benchmarks/dpo_packing.py [--pairs 32] [--cap 256] [--caps 256 512 1024] [--rounds 3]
        [--steps 2] [--json OUT] [key=value ...]

Overrides go to configs/dpo_tiny.yaml (its 2-layer, d_model 64 byte-level decoder). Pairs whose
prompt alone fills C are dropped (the trainer refuses them), counted in the JSON.
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


def efficiency(pairs: list[PairIds], cap: int, max_pairs: int) -> tuple[dict, dict, dict]:
    """The pairs truncated to `cap` tokens a sequence (keep_start), as unpacked rows of `cap` tokens
    and packed into rows of 2 x cap (any pair fits): (figures, unpacked arrays, packed-row arrays)."""
    report = PreferenceReport()
    kept = [p for p in pairs if len(p.prompt) < cap]  # a prompt filling the row: refused by the trainer
    unpacked = collate(kept, cap, report=report)
    wide = collate(kept, 2 * cap, max_length=cap)
    packed = pack_pairs(wide, max_pairs)
    lens = unpacked["attention"].sum(-1).ravel()
    figures = {
        "sequence_cap": cap,
        "pairs": len(kept),
        "dropped_prompt_fills_row": len(pairs) - len(kept),
        "truncated_pairs": report.truncated,
        "sequence_tokens": {
            "median": float(np.median(lens)),
            "mean": float(lens.mean()),
            "p90": float(np.percentile(lens, 90)),
        },
        "unpacked": {"rows": 2 * len(kept), "row_len": cap, "efficiency": float(lens.sum() / (2 * len(kept) * cap))},
        "packed": {"rows": len(packed), "row_len": 2 * cap, "efficiency": packed.stats.efficiency},
        "pairs_per_packed_row": len(kept) / len(packed),
    }
    return figures, unpacked, wide


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pairs", type=int, default=32, help="pairs per timed step")
    ap.add_argument("--cap", type=int, default=256, help="tokens a sequence keeps in the timed steps")
    ap.add_argument("--caps", type=int, nargs="*", default=[256, 512, 1024], help="caps the efficiency is reported for")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="steps per variant per round")
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    base, cap = list(args.overrides), args.cap
    max_pairs = max_pairs_for(load_run_config(CONFIG, base).model.max_segments)
    pairs = stdlib_pairs()
    eff = {c: efficiency(pairs, c, max_pairs)[0] for c in args.caps}
    _, unpacked, wide = efficiency(pairs, cap, max_pairs)
    # the timed pairs: random ids (vocab 256) of the real lengths, both layouts of the same pairs
    rng = np.random.default_rng(0)
    ids = {k: v[: args.pairs] for k, v in unpacked.items()}
    ids["tokens"] = np.where(ids["attention"] > 0, rng.integers(3, 256, ids["tokens"].shape), 0).astype(np.int32)
    wide = {k: v[: args.pairs] for k, v in wide.items()}
    wide["tokens"][:, :, :cap] = ids["tokens"]
    packed = pack_pairs(wide, max_pairs)
    n = jax.device_count()
    rows = -(-len(packed) // n) * n
    pbatch = packed.rows(np.arange(len(packed)))
    fill = packed.empty_rows(rows - len(packed))
    pbatch = {k: np.concatenate([v, fill[k]]) for k, v in pbatch.items()}
    seq = [f"model.max_seq_len={2 * cap}"]
    unp_cfg = base + seq + [f"data.seq_len={cap - 1}", "preference.max_length=0", f"train.global_batch={args.pairs}"]
    pk_cfg = base + seq + [f"data.seq_len={2 * cap - 1}", f"preference.max_length={cap}", "preference.packing=true"]
    variants = {
        "unpacked": (load_run_config(CONFIG, unp_cfg), ids),
        "packed": (load_run_config(CONFIG, pk_cfg + [f"train.global_batch={rows}"]), pbatch),
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
            "row_len": vcfg.data.seq_len + 1,
            "step_s": step_s,
            "pairs_per_s": args.pairs / step_s,
            "peak_bytes": peaks[name],
        }
    res["packed"]["step_vs_unpacked"] = res["packed"]["step_s"] / res["unpacked"]["step_s"]
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
        "efficiency": list(eff.values()),
        "results": res,
    }
    for e in eff.values():
        print(
            f"cap {e['sequence_cap']:5d}: {e['pairs']} pairs, sequences median {e['sequence_tokens']['median']:.0f} / "
            f"p90 {e['sequence_tokens']['p90']:.0f}; unpacked {e['unpacked']['rows']} rows of {e['unpacked']['row_len']}, "
            f"efficiency {e['unpacked']['efficiency']:.3f}; packed {e['packed']['rows']} rows of {e['packed']['row_len']}, "
            f"{e['packed']['efficiency']:.3f} ({e['pairs_per_packed_row']:.2f} pairs a row)"
        )
    for name, r in res.items():
        print(
            f"{name:9s} {args.pairs} pairs in {r['rows']:3d} rows of {r['row_len']}  step {r['step_s'] * 1e3:8.1f} ms  "
            f"{r['pairs_per_s']:6.2f} pairs/s  peak {r['peak_bytes'] / 2**20:.1f} MiB"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
