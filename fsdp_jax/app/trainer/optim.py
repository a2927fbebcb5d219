"""Optimizer and learning-rate schedule from an `OptimizerConfig`-shaped object."""

from __future__ import annotations

import jax
import optax

from fsdp_jax.sharding.leaf_sharding import path_str


def lr_schedule(lr: float, warmup_steps: int, total_steps: int, min_lr_ratio: float) -> optax.Schedule:
    """Linear warmup from 0 to `lr`, then cosine decay to `lr * min_lr_ratio` at `total_steps`."""
    warmup = max(0, min(warmup_steps, total_steps - 1))
    return optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=lr,
        warmup_steps=warmup,
        decay_steps=max(total_steps, warmup + 1),
        end_value=lr * min_lr_ratio,
    )


def decay_mask(params):
    """Weight decay on matrices only: not on norm scales or biases (stacked or not; a name ending
    in `bias`: DeepSeek-V3's `score_bias`, which training must leave as imported, gpt-oss's
    `router_bias`)."""

    def keep(path, x):
        name = path_str(path).rsplit("/", 1)[-1]
        return x.ndim >= 2 and name != "scale" and not name.endswith("bias")

    return jax.tree_util.tree_map_with_path(keep, params)


def build_optimizer(cfg, total_steps: int) -> tuple[optax.GradientTransformation, optax.Schedule]:
    """(optax transform, schedule) for `cfg.name` in adamw | sgd | adafactor.
    Clipping is not part of the transform: the train step clips by global norm."""
    sched = lr_schedule(cfg.lr, cfg.warmup_steps, total_steps, cfg.min_lr_ratio)
    if cfg.name == "adamw":
        tx = optax.adamw(sched, b1=cfg.b1, b2=cfg.b2, eps=cfg.eps, weight_decay=cfg.weight_decay, mask=decay_mask)
    elif cfg.name == "sgd":
        tx = optax.sgd(sched, momentum=cfg.momentum or None)
    elif cfg.name == "adafactor":
        tx = optax.adafactor(sched, weight_decay_rate=cfg.weight_decay or None, weight_decay_mask=decay_mask)
    else:
        raise ValueError(f"optimizer.name: unknown optimizer {cfg.name!r}; choose adamw, sgd or adafactor")
    return tx, sched
