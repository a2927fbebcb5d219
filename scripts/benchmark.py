#!/usr/bin/env python
"""Measure compile time, step time, tokens/s, MFU and peak memory per strategy.

    python scripts/benchmark.py --config configs/tiny.yaml [--strategies full_shard,no_shard]
        [--steps 10] [--warmup 2] [--sweep model.n_layers=4,8,16,32] [--sweep devices=1,2,4,8]
        [--baselines] [--peak-tflops T] [--json] [--plot sweep.png] [key=value ...]

Inputs are random tokens (no data set needed). `--baselines` adds two reference
rows at the same global batch: the same model on one device (`single_device`) and
a plain hand-written JAX data-parallel loop (`plain_dp`: replicated params, batch
sharded, `jax.jit` + `jax.value_and_grad` + optax, no fsdp_jax code in the step).
The sweep key `devices` runs on the first N devices. The persistent compilation
cache is off, so compile times are real. On CPU the process gets
FSDP_JAX_CPU_DEVICES (default 8) host devices. Exit codes: 0, 2 bad input, 1 other.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line on stderr, exit code 2."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


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
    """Compile and time the trainer's own step (`fsdp_jax.app.step_build.build_step`) for
    `strategy` on `devices`."""
    import jax
    import numpy as np

    from fsdp_jax.memory import compiled_memory
    from fsdp_jax.perf import time_steps
    from fsdp_jax.app.step_build import build_step, sample_batch

    build = build_step(cfg, strategy, devices)
    state = build.init_state(jax.random.key(0))
    tokens = sample_batch(cfg, build.batch, np.random.default_rng(0))  # tokens, or a packed batch
    batch = jax.device_put(tokens, build.plan.batch)
    t = time.perf_counter()
    compiled = build.step.lower(state, batch).compile()
    compile_s = time.perf_counter() - t
    _, _, times = time_steps(compiled, state, batch, steps, warmup)
    return compile_s, times, compiled_memory(compiled)


def bench_plain_dp(cfg, devices, steps: int, warmup: int):
    """A hand-written data-parallel loop: replicated params, batch split over devices."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from fsdp_jax.adapters import from_nnx
    from fsdp_jax.memory import compiled_memory
    from fsdp_jax.app.models.llama import Llama, cross_entropy
    from fsdp_jax.app.optim import build_optimizer
    from fsdp_jax.perf import time_steps

    mesh = Mesh(np.asarray(devices), ("dp",))
    model = from_nnx(lambda r: Llama(cfg.model, rngs=r, remat=cfg.remat))
    tx, _ = build_optimizer(cfg.optimizer, cfg.train.steps)
    if cfg.optimizer.clip_norm:
        tx = optax.chain(optax.clip_by_global_norm(cfg.optimizer.clip_norm), tx)
    rep, data = NamedSharding(mesh, P()), NamedSharding(mesh, P("dp"))
    params = jax.jit(model.init, out_shardings=rep)(jax.random.key(0))
    opt_state = jax.jit(tx.init, out_shardings=rep)(params)

    def step(carry, tokens):
        p, s = carry
        loss, g = jax.value_and_grad(
            lambda p: cross_entropy(model.apply(p, tokens[:, :-1]), tokens[:, 1:]))(p)
        u, s = tx.update(g, s, p)
        return (optax.apply_updates(p, u), s), loss

    jitted = jax.jit(step, in_shardings=((rep, rep), data), out_shardings=((rep, rep), rep),
                     donate_argnums=0)
    tokens = np.random.default_rng(0).integers(
        0, cfg.model.vocab_size, (cfg.train.global_batch, cfg.data.seq_len + 1), dtype=np.int32)
    batch = jax.device_put(tokens, data)
    t = time.perf_counter()
    compiled = jitted.lower((params, opt_state), batch).compile()
    compile_s = time.perf_counter() - t
    _, _, times = time_steps(compiled, (params, opt_state), batch, steps, warmup)
    return compile_s, times, compiled_memory(compiled)


def main(argv: list[str] | None = None) -> int:
    from fsdp_jax.app.flags import int_in, real_in
    ap = _Parser(description="fsdp_jax benchmark")
    ap.add_argument("--config", required=True)
    ap.add_argument("--strategies", default="full_shard,shard_grad_op,shard_opt,no_shard,hybrid_shard")
    ap.add_argument("--steps", type=int_in(1), default=10)
    ap.add_argument("--warmup", type=int_in(0), default=2)
    ap.add_argument("--sweep", action="append", default=[], help="KEY=V1,V2 (repeatable)")
    ap.add_argument("--baselines", action="store_true", help="add single_device and plain_dp rows")
    ap.add_argument("--peak-tflops", type=real_in(0, above=True), default=None, help="peak TFLOP/s per device for MFU")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--plot", help="PNG of step time / compile time / memory against the first sweep key")
    ap.add_argument("overrides", nargs="*")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    import jax

    from fsdp_jax.app.cli import BAD_INPUT, check_out_file, fail, require, use_cpu_devices
    from fsdp_jax.app.config import ConfigError, check_backend, load_config, validate
    from fsdp_jax.app.models.llama import flops_per_token
    from fsdp_jax.perf import mfu, peak_flops
    from fsdp_jax.precision import Policy
    from fsdp_jax.strategy import get_strategy

    try:
        use_cpu_devices()
        if args.plot:
            check_out_file(args.plot, "--plot")
            require("matplotlib", "--plot")
        sweeps = parse_sweeps(args.sweep)
        strategies = [get_strategy(s).name for s in args.strategies.split(",") if s]
        if not strategies:
            raise ConfigError("--strategies", f"{args.strategies!r} names no strategy")
        load_config(args.config, args.overrides)  # fail early on a bad config
        jax.config.update("jax_enable_compilation_cache", False)  # inputs checked: time cold compiles
        runs = []
        for combo in combos(sweeps):
            try:
                n_dev = int(combo.get("devices", jax.device_count()))
            except ValueError:
                raise ConfigError("--sweep devices", f"{combo['devices']!r} is not an integer") from None
            if not 1 <= n_dev <= jax.device_count():
                raise ConfigError("--sweep devices", f"{n_dev}: choose 1..{jax.device_count()}")
            cfg = load_config(args.config, list(args.overrides) + [f"{k}={v}" for k, v in combo.items()
                                                                     if k != "devices"])
            validate(cfg, n_devices=n_dev)
            check_backend(cfg, jax.default_backend())
            runs.append((combo, cfg, n_dev))
    except (*BAD_INPUT, ValueError) as e:
        return fail(e)

    devices_all = jax.devices()
    results = []
    for combo, cfg, n_dev in runs:
        devices = devices_all[:n_dev]
        fpt = flops_per_token(cfg.model, cfg.data.seq_len)
        peak = peak_flops(devices[0], Policy.parse(cfg.precision).compute_dtype.name, args.peak_tflops)
        tokens = cfg.train.global_batch * cfg.data.seq_len
        rows = [(s, lambda s=s: bench_fsdp(cfg, s, devices, args.steps, args.warmup)) for s in strategies]
        if args.baselines:
            rows.append(("single_device", lambda: bench_fsdp(cfg, "no_shard", devices[:1], args.steps, args.warmup)))
            rows.append(("plain_dp", lambda: bench_plain_dp(cfg, devices, args.steps, args.warmup)))
        for name, fn in rows:
            compile_s, times, mem = fn()
            peak_bytes = mem["peak"]
            med = statistics.median(times)
            rec = {"strategy": name, "devices": 1 if name == "single_device" else n_dev,
                   "compile_s": round(compile_s, 4), "step_s_median": med, "step_s_min": min(times),
                   "step_s_max": max(times), "tokens_per_s": tokens / med,
                   "mfu": mfu(fpt, tokens / med, 1 if name == "single_device" else n_dev, peak),
                   "peak_bytes": int(peak_bytes), "argument_bytes": mem["argument"], **{k: v for k, v in combo.items() if k != "devices"}}
            results.append(rec)
            if not args.json:
                extra = " ".join(f"{k}={v}" for k, v in combo.items())
                print(f"{name:14s} {extra:24s} compile {compile_s:7.2f}s  step {med * 1e3:8.1f} ms "
                      f"[{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}]  {tokens / med:10.0f} tok/s  "
                      f"peak {peak_bytes / 2**20:8.1f} MiB  state+batch {mem['argument'] / 2**20:7.2f} MiB",
                      flush=True)
    doc = {"config": args.config, "devices": jax.device_count(), "backend": jax.default_backend(),
           "device_kind": devices_all[0].device_kind, "steps": args.steps, "overrides": args.overrides,
           "sweeps": {k: v for k, v in sweeps}, "results": results}
    if args.json:
        print(json.dumps(doc))
    if args.plot and sweeps:
        plot(doc, sweeps[0][0], args.plot)
    return 0


def plot(doc: dict, key: str, out: str) -> None:
    """One line per strategy and combination of the other swept keys, against `key`."""
    from fsdp_jax.app.extras import require
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


if __name__ == "__main__":
    sys.exit(main())
