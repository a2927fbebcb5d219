#!/usr/bin/env python
"""Why gpt-oss's clamped experts' output-gradient histories part between layouts under the
delayed FP8 recipe (docs/fp8.md "Issue 62, 2026-12-07 (helper)").

    PYTHONPATH=. python benchmarks/fp8_gpt_oss_history_gap.py

The config of tests/test_fp8_experts.py's gpt-oss test (the tiny golden, 2 layers, delayed, f32
compute, 8 CPU devices). Prints, as JSON, the largest relative gap of the newest gradient-row
entry of each history against one device, per step, for: full_shard; one device from params
perturbed by 1e-7 and 1e-6 relative noise; with the clamp binding (limit 0.2) and not (1e4).
Then, with the clamp, which entries differ after step 1 from the same init, and step 2 run in
both layouts from one device's state after step 1. 25 CPU seconds with the suite's compilation cache warm.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import conftest  # noqa: E402,F401  (8 CPU devices, the suite's XLA flags and caches)
import jax  # noqa: E402
import numpy as np  # noqa: E402
from test_fp8 import batches, built  # noqa: E402
from test_fp8_experts import moe_cfg  # noqa: E402
from test_hf import GOLDEN  # noqa: E402

from fsdp_jax.app.hf import load  # noqa: E402


def cfg(limit):
    oss = dataclasses.replace(load.HFCheckpoint(GOLDEN / "gpt_oss").config, n_layers=2, swiglu_limit=limit)
    return dataclasses.replace(moe_cfg("delayed"), model=oss)


def hists(state):
    flat = jax.tree_util.tree_flatten_with_path(state.model_state)[0]
    return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat if "moe" in jax.tree_util.keystr(p)}


def run(b, data, eps=0.0):
    state = b.init_state(jax.random.key(0))
    if eps:
        leaves, tdef = jax.tree.flatten(state.params)
        keys = jax.random.split(jax.random.key(7), len(leaves))
        leaves = [x * (1 + eps * jax.random.normal(k, x.shape, x.dtype)) for x, k in zip(leaves, keys)]
        state = state.replace(params=jax.tree.unflatten(tdef, leaves))
    out = []
    for batch in data:
        state, _ = b.train_step(state, batch)
        out.append(hists(jax.device_get(state)))
    return out


def rel(a, b, row=2):
    """Largest relative gap of the newest entry of `row` (2: the output gradient), per history."""
    return {
        k: float(np.max(np.abs(a[k][..., row, 0] - b[k][..., row, 0]) / np.maximum(np.abs(b[k][..., row, 0]), 1e-30)))
        for k in a
    }


def main() -> int:
    res = {}
    for limit in (0.2, 1e4):
        c = cfg(limit)
        data = [x % c.model.vocab_size for x in batches(2)]
        b1, b8 = built(c, "no_shard", 1), built(c, "full_shard", 8)
        ref = run(b1, data)
        for eps in (1e-7, 1e-6):
            res[f"limit {limit}, one device, eps {eps}"] = [
                max(rel(p, r).values()) for p, r in zip(run(b1, data, eps), ref)
            ]
        res[f"limit {limit}, full_shard"] = [max(rel(f, r).values()) for f, r in zip(run(b8, data), ref)]
        if limit != 0.2:
            continue
        # step 1 from the same init: the entries that differ; step 2 from the same state
        one = b1.train_step(b1.init_state(jax.random.key(0)), data[0])[0]
        eight = b8.train_step(b8.init_state(jax.random.key(0)), data[0])[0]
        h1, h8 = hists(jax.device_get(one)), hists(jax.device_get(eight))
        res["step 1 entries over 1e-6 apart"] = {
            f"{k} row {row}": np.argwhere(
                np.abs(h1[k][..., row, 0] - h8[k][..., row, 0]) > 1e-6 * np.abs(h1[k][..., row, 0])
            ).tolist()
            for k in h1
            for row in range(3)
        }
        same = jax.device_put(jax.device_get(one), jax.tree.map(lambda a: a.sharding, b8.abstract_state))
        t1, t8 = b1.train_step(one, data[1])[0], b8.train_step(same, data[1])[0]
        res["step 2 from the same state, full_shard"] = max(
            rel(hists(jax.device_get(t8)), hists(jax.device_get(t1))).values()
        )
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
