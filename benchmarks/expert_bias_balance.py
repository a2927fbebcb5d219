"""The aux-loss-free bias rule's effect alone (docs/moe.md, "DeepSeek-V3's balancing"): the tiny
DeepSeek-V3 golden (tests/golden/hf/deepseek_v3) trained with a zero learning rate, so only the
score-correction bias moves, on a fixed batch of random tokens; prints each sparse layer's max load
/ the balanced share (1 = balanced) at the start and after `--steps` steps, for each bias update speed.

    python benchmarks/expert_bias_balance.py [--steps 40] [--speeds 0 0.001 0.01]
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import jax
import numpy as np
import optax

from fsdp_jax.app.hf import load
from fsdp_jax.app.models import Decoder
from fsdp_jax.app.trainer.build import make_loss_fn
from fsdp_jax.app.trainer.expert_bias import bias_rule, without_bias_state
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build

GOLDEN = Path(__file__).resolve().parents[1] / "tests" / "golden" / "hf" / "deepseek_v3"


def imbalance(counts: np.ndarray) -> list[float]:
    """Per sparse layer: max tokens on one expert / the balanced share."""
    return [float(c.max() * c.size / c.sum()) for c in counts if c.sum()]


def run(speed: float, steps: int) -> tuple[list[float], list[float]]:
    ckpt = load.HFCheckpoint(GOLDEN)
    cfg = dataclasses.replace(ckpt.config, bias_update_speed=speed)
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    opts = {"post_update": bias_rule(cfg)} if speed else {}
    built = build(
        m,
        without_bias_state(optax.sgd(0.0)),
        make_mesh(1, 1, 1, devices=jax.devices()[:1]),
        "full_shard",
        loss_fn=make_loss_fn(m, cfg),
        has_aux=True,
        min_shard_size=0,
        **opts,
    )
    state = built.state_from_params(load.load_params(ckpt, built.abstract_state.params))
    batch = jax.random.randint(jax.random.key(0), (8, 65), 0, cfg.vocab_size)
    first = last = None
    for _ in range(steps):
        state, metrics = built.train_step(state, batch)
        counts = np.asarray(metrics["aux"]["expert_counts"])
        first = imbalance(counts) if first is None else first
        last = imbalance(counts)
    return first, last


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--speeds", type=float, nargs="+", default=[0.0, 0.001, 0.01])
    args = ap.parse_args()
    for u in args.speeds:
        first, last = run(u, args.steps)
        print(
            f"u={u:g}: max load / balanced share per sparse layer, step 1 "
            f"{', '.join(f'{x:.3f}' for x in first)} -> step {args.steps} {', '.join(f'{x:.3f}' for x in last)}"
        )


if __name__ == "__main__":
    main()
