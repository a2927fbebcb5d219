"""The DPO step against the SFT step on the same rows, on 8 CPU devices (issue 57's numbers):
tokens/s of each measured step (both rows of a pair counted, as the trainer logs them), their
ratio, and the compiled peak bytes per device (`memory_analysis()`), for

- `sft`: next-token loss on 2 x global_batch rows;
- `dpo`: the policy's forward + backward on the same rows plus the reference's forward (a frozen
  copy in model state, no gradient);
- `dpo_precomputed`: reference log-probs in the batch (`precompute_ref_log_probs`): no reference;
- with `--lora`, `lora_sft` / `lora_dpo`: the reference is the base with the adapters off.

The steps are timed in interleaved rounds (each round one block of every variant), so load that
drifts during the run falls on all of them alike; the figure is the median over rounds.

    python benchmarks/dpo_vs_sft.py [--rounds 5] [--steps 3] [--lora] [--json OUT] [key=value ...]

Overrides go to configs/dpo_tiny.yaml for every variant. What to expect (`fsdp_jax.app.planner.
step_time.reference_flops_per_token`): the reference costs one forward, a third of the policy's
forward + backward, so DPO's step is about 4/3 of SFT's (tokens/s about 3/4), not double.
CPU figures compare the steps on one machine; they are not a GPU prediction.
"""

import argparse
import json
import statistics
import sys
import time

import jax
import numpy as np

jax.config.update("jax_num_cpu_devices", 8)

from fsdp_jax.app.planner.abstract_step import build_step, sample_batch  # noqa: E402
from fsdp_jax.app.planner.step_time import step_rows  # noqa: E402
from fsdp_jax.app.trainer.setup import load_run_config  # noqa: E402

CONFIG = "configs/dpo_tiny.yaml"
SIZE = ["model.d_model=256", "model.ffn_dim=1024", "model.n_heads=8", "model.n_kv_heads=4"]


def variants(lora: bool, pairs: int) -> dict[str, list[str]]:
    sft = ["objective=sft", "data.source=none", f"train.global_batch={2 * pairs}"]
    out = {"sft": sft, "dpo": [], "dpo_precomputed": ["preference.precompute_ref_log_probs=true"]}
    if lora:
        adapters = ["lora.rank=16", "lora.alpha=32"]
        out.update(lora_sft=sft + adapters, lora_dpo=adapters)
    return out


def prepared(cfg):
    """(step, state, batch, compiled peak bytes) of the trainer's step for `cfg`."""
    b = build_step(cfg)
    peak = b.compile().memory_analysis().peak_memory_in_bytes
    state = b.init_state(jax.random.key(0))
    batch = jax.device_put(sample_batch(cfg, b.batch, np.random.default_rng(0)), b.plan.batch)
    for _ in range(2):  # warm-up (compile, first dispatch)
        state, m = b.step(state, batch)
        float(m["loss"])
    return [b.step, state, batch], peak


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--steps", type=int, default=3, help="steps per variant per round")
    ap.add_argument("--lora", action="store_true")
    ap.add_argument("--json")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args(argv)
    base = SIZE + list(args.overrides)
    pairs = load_run_config(CONFIG, base).train.global_batch
    cfgs = {name: load_run_config(CONFIG, base + extra) for name, extra in variants(args.lora, pairs).items()}
    runs, peaks = {}, {}
    for name, cfg in cfgs.items():
        runs[name], peaks[name] = prepared(cfg)
    times = {name: [] for name in cfgs}
    for _ in range(args.rounds):
        for name, run in runs.items():
            step, state, batch = run
            t0 = time.perf_counter()
            for _ in range(args.steps):
                state, m = step(state, batch)
                float(m["loss"])  # block on each step
            times[name].append((time.perf_counter() - t0) / args.steps)
            run[1] = state
    rows = {}
    for name, cfg in cfgs.items():
        step_s = statistics.median(times[name])
        tokens = cfg.train.global_batch * cfg.data.seq_len * step_rows(cfg)
        rows[name] = {"step_s": step_s, "tokens_per_s": tokens / step_s, "rows": tokens // cfg.data.seq_len}
        rows[name]["peak_bytes"] = int(peaks[name])
    for name in rows:
        ref = "lora_sft" if name.startswith("lora") else "sft"
        rows[name]["step_vs_sft"] = rows[name]["step_s"] / rows[ref]["step_s"]
    doc = {
        "command": "python benchmarks/dpo_vs_sft.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "config": CONFIG,
        "overrides": base,
        "devices": jax.device_count(),
        "device_kind": jax.devices()[0].device_kind,
        "rounds": args.rounds,
        "steps_per_round": args.steps,
        "results": rows,
    }
    for name, r in rows.items():
        print(
            f"{name:16s} {r['rows']:4d} rows  step {r['step_s'] * 1e3:8.1f} ms  {r['tokens_per_s']:9,.0f} tok/s  "
            f"x{r['step_vs_sft']:.2f} of SFT's step  peak {r['peak_bytes'] / 2**20:.1f} MiB"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
