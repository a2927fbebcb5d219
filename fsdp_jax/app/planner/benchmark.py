"""Benchmark runners: the trainer's own step per strategy (`bench_fsdp`), a hand-written
data-parallel baseline (`bench_plain_dp`), sweeps over config keys, and their plot.
`fsdp-jax benchmark` is the command over them."""

from __future__ import annotations

import time

import jax
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.app.extras import require
from fsdp_jax.app.models.decoder import cross_entropy
from fsdp_jax.app.planner.abstract_step import build_step, sample_batch
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.app.trainer.optim import build_optimizer
from fsdp_jax.hlo.memory import compiled_memory
from fsdp_jax.targets.perf import time_steps


def parse_sweeps(items: list[str]) -> list[tuple[str, list[str]]]:
    out = []
    for item in items:
        key, sep, values = item.partition("=")
        if not sep or not key or not values:
            raise ValueError(f"--sweep {item!r}: expected KEY=V1,V2,... (e.g. model.n_layers=4,8,16)")
        vals = [v for v in values.split(",") if v.strip()]
        if not vals:
            raise ValueError(f"--sweep {item!r}: no values; expected KEY=V1,V2,...")
        out.append((key, vals))
    return out


def combos(sweeps):
    if not sweeps:
        yield {}
        return
    (key, values), rest = sweeps[0], sweeps[1:]
    for v in values:
        for tail in combos(rest):
            yield {key: v, **tail}


def bench_fsdp(cfg, strategy: str, devices, steps: int, warmup: int):
    """Compile and time the trainer's own step (`fsdp_jax.app.planner.abstract_step.build_step`) for
    `strategy` on `devices`."""

    build = build_step(cfg, strategy, devices)
    state = build.init_state(jax.random.key(0))
    tokens = sample_batch(cfg, build.batch, np.random.default_rng(0))
    batch = jax.device_put(tokens, build.plan.batch)
    t = time.perf_counter()
    compiled = build.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    _, _, times = time_steps(compiled, state, batch, steps, warmup)
    return compile_s, times, compiled_memory(compiled)


def bench_plain_dp(cfg, devices, steps: int, warmup: int):
    """A hand-written data-parallel loop: replicated params, batch split over devices."""

    mesh = Mesh(np.asarray(devices), ("dp",))
    model = trainer_model(cfg.model, cfg.remat)
    tx, _ = build_optimizer(cfg.optimizer, cfg.train.steps)
    if cfg.optimizer.clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(cfg.optimizer.clip_norm), tx)
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    params = jax.jit(model.init, out_shardings=rep)(jax.random.key(0))
    opt_state = jax.jit(tx.init, out_shardings=rep)(params)

    def step(carry, tokens):
        p, s = carry
        loss, g = jax.value_and_grad(lambda p: cross_entropy(model.apply(p, tokens[:, :-1]), tokens[:, 1:]))(p)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), loss

    jitted = jax.jit(step, in_shardings=((rep, rep), data), out_shardings=((rep, rep), rep), donate_argnums=0)
    tokens = np.random.default_rng(0).integers(
        0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.data.seq_len + 1), dtype=np.int32
    )
    batch = jax.device_put(tokens, data)
    t = time.perf_counter()
    compiled = jitted.lower((params, opt_state), batch).compile()
    compile_s = time.perf_counter() - t
    _, _, times = time_steps(compiled, (params, opt_state), batch, steps, warmup)
    return compile_s, times, compiled_memory(compiled)


def plot(doc: dict, key: str, out: str) -> None:
    """One line per strategy and combination of the other swept keys, against `key`."""

    matplotlib = require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    others = [k for k in doc["sweeps"] if k != key]
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    lines: dict[str, list[dict]] = {}
    for r in doc["results"]:
        label = " ".join([r["strategy"]] + [f"{k.rsplit('.', 1)[-1]}={r.get(k)}" for k in others])
        lines.setdefault(label, []).append(r)
    for label, rs in lines.items():
        xs = [r["devices"] if key == "devices" else float(r[key]) for r in rs]
        for ax, field, scale in zip(axes, ("step_s_median", "compile_s", "peak_bytes"), (1e3, 1, 2**-20)):
            ax.plot(xs, [r[field] * scale for r in rs], "o-", label=label)
    for ax, title in zip(axes, ("step time (ms)", "compile time (s)", "compiled peak per device (MiB)")):
        ax.set(xlabel=key, title=title)
        ax.grid(alpha=0.3)
    axes[1].legend()
    fig.suptitle(f"{doc['config']} on {doc['devices']} x {doc['device_kind']}")
    fig.tight_layout()
    fig.savefig(out, dpi=100)
