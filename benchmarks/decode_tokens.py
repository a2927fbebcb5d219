#!/usr/bin/env python
"""Decode tokens/s of KV-cache generation over the training mesh (issue 58).

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/decode_tokens.py [--devices 8] [--rows 64]
        [--prompt 32] [--new 64] [--strategy full_shard] [--repeats 3]

The tiny config's decoder widened to d_model 256, 4 layers (8 q / 2 kv heads),
params f32 sharded by `--strategy` over `--devices` CPU devices, `--rows` rows of
`--prompt` tokens, `--new` new tokens each (no stop token: every row runs to the end),
temperature 1 with top-k 50. Reports the median wall time of `--repeats` calls after a
compile, and new tokens per second over all rows (prefill included in the time). One JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import jax

ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
ap.add_argument("--devices", type=int, default=8)
ap.add_argument("--rows", type=int, default=64)
ap.add_argument("--prompt", type=int, default=32)
ap.add_argument("--new", type=int, default=64)
ap.add_argument("--strategy", default="full_shard")
ap.add_argument("--repeats", type=int, default=3)
args = ap.parse_args()
jax.config.update("jax_num_cpu_devices", args.devices)

import numpy as np  # noqa: E402
import optax  # noqa: E402

from fsdp_jax.app.models.config import DecoderConfig  # noqa: E402
from fsdp_jax.app.models.generate import SamplingSpec, left_pad  # noqa: E402
from fsdp_jax.app.objectives.rollout import make_sampler  # noqa: E402
from fsdp_jax.app.trainer.build import trainer_model  # noqa: E402
from fsdp_jax.sharding.mesh import make_mesh  # noqa: E402
from fsdp_jax.train.build import build  # noqa: E402


def main() -> None:
    cfg = DecoderConfig(
        vocab_size=256,
        d_model=256,
        n_layers=4,
        n_heads=8,
        n_kv_heads=2,
        ffn_dim=704,
        max_seq_len=args.prompt + args.new,
    )
    model = trainer_model(cfg)
    mesh = make_mesh(1, args.devices, devices=jax.devices()[: args.devices])
    built = build(model, optax.sgd(0.1), mesh, args.strategy, min_shard_size=0)
    params = jax.device_put(model.init(jax.random.key(0)), built.plan.params)
    spec = SamplingSpec(max_new_tokens=args.new, temperature=1.0, top_k=50)
    rng = np.random.default_rng(0)
    rows = [rng.integers(1, 256, rng.integers(args.prompt // 2, args.prompt + 1)).tolist() for _ in range(args.rows)]
    prompts, lengths = left_pad(rows, width=args.prompt)
    sample = make_sampler(model, built.plan, spec)
    t0 = time.perf_counter()
    jax.block_until_ready(sample(params, prompts, lengths, jax.random.key(0)))
    compile_s = time.perf_counter() - t0
    times = []
    for i in range(args.repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(sample(params, prompts, lengths, jax.random.key(i + 1)))
        times.append(time.perf_counter() - t0)
    new = int(np.asarray(out["lengths"]).sum())
    med = statistics.median(times)
    print(
        json.dumps(
            {
                "devices": args.devices,
                "strategy": args.strategy,
                "rows": args.rows,
                "prompt": args.prompt,
                "new_tokens": args.new,
                "first_call_s": round(compile_s, 2),
                "median_s": round(med, 3),
                "decode_tokens_per_s": round(new / med, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
