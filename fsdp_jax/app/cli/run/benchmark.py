"""`fsdp-jax benchmark` once its flags have parsed (they and its description: fsdp_jax.app.cli.benchmark)."""

from __future__ import annotations

import json
import statistics

import jax

from fsdp_jax.app.cli.args import check_out_file, require
from fsdp_jax.app.config.checks import check_backend, validate
from fsdp_jax.app.devices import use_cpu_devices, without_compilation_cache
from fsdp_jax.app.models.decoder import flops_per_token
from fsdp_jax.app.planner.benchmark import bench_fsdp, bench_plain_dp, combos, parse_sweeps, plot
from fsdp_jax.app.planner.step_time import reference_flops_per_token, step_rows
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.errors import ConfigError, UsageError, one_line
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.strategy import get_strategy
from fsdp_jax.targets.perf import mfu, peak_flops


def run(args) -> int:
    """Check every input (flags, then the config of each sweep point), then measure each
    point's rows and report them."""

    use_cpu_devices()
    sweeps, strategies = _parse_flags(args)
    with without_compilation_cache():  # inputs checked: time cold compiles
        runs = _checked_runs(args, sweeps)
        devices_all = jax.devices()
        results = []
        for combo, cfg, n_dev in runs:
            results += _bench_point(args, combo, cfg, devices_all[:n_dev], strategies)
    _report(args, sweeps, results, devices_all)
    return 0


def _parse_flags(args) -> tuple[list, list[str]]:
    """(sweeps, strategy names) from the flags; the --plot file and the config checked."""

    if args.plot:
        check_out_file(args.plot, "--plot")
        require("matplotlib", "--plot")
    try:  # ValueError names the flag
        sweeps = parse_sweeps(args.sweep)
        strategies = [get_strategy(s).name for s in args.strategies.split(",") if s]
    except ValueError as e:
        raise UsageError(one_line(e, None)) from None
    if not strategies:
        raise ConfigError("--strategies", f"{args.strategies!r} names no strategy")
    cfg = load_run_config(args.config, args.overrides)  # fail early on a bad config
    if args.baselines and cfg.objective != "sft":  # the baselines' loops train next-token loss
        raise UsageError(f"--baselines: only with objective=sft (the config's objective is {cfg.objective})")
    return sweeps, strategies


def _checked_runs(args, sweeps) -> list[tuple[dict, object, int]]:
    """[(sweep point, its validated config, its device count)], every point checked
    before anything is measured."""

    runs = []
    for combo in combos(sweeps):
        try:
            n_dev = int(combo.get("devices", jax.device_count()))
        except ValueError:
            raise ConfigError("--sweep devices", f"{combo['devices']!r} is not an integer") from None
        if not 1 <= n_dev <= jax.device_count():
            raise ConfigError("--sweep devices", f"{n_dev}: choose 1..{jax.device_count()}")
        cfg = load_run_config(
            args.config, list(args.overrides) + [f"{k}={v}" for k, v in combo.items() if k != "devices"]
        )
        validate(cfg, n_devices=n_dev)
        check_backend(cfg, jax.default_backend())
        runs.append((combo, cfg, n_dev))
    return runs


def _bench_point(args, combo: dict, cfg, devices: list, strategies: list[str]) -> list[dict]:
    """One sweep point's rows (each strategy, and the baselines), each printed as it is
    measured unless --json."""

    n_dev = len(devices)
    fpt = flops_per_token(cfg.model, cfg.data.seq_len) + reference_flops_per_token(cfg)  # a DPO step's reference
    peak = peak_flops(devices[0], Policy.parse(cfg.precision).compute_dtype.name, args.peak_tflops)
    tokens = cfg.train.global_batch * cfg.data.seq_len * step_rows(cfg)  # both rows of a preference pair
    rows = [(s, lambda s=s: bench_fsdp(cfg, s, devices, args.steps, args.warmup)) for s in strategies]
    if args.baselines:
        rows.append(("single_device", lambda: bench_fsdp(cfg, "no_shard", devices[:1], args.steps, args.warmup)))
        rows.append(("plain_dp", lambda: bench_plain_dp(cfg, devices, args.steps, args.warmup)))
    results = []
    for name, fn in rows:
        compile_s, times, mem = fn()
        peak_bytes = mem["peak"]
        med = statistics.median(times)
        rec = {
            "strategy": name,
            "devices": 1 if name == "single_device" else n_dev,
            "compile_s": round(compile_s, 4),
            "step_s_median": med,
            "step_s_min": min(times),
            "step_s_max": max(times),
            "tokens_per_s": tokens / med,
            "mfu": mfu(fpt, tokens / med, 1 if name == "single_device" else n_dev, peak),
            "peak_bytes": int(peak_bytes),
            "argument_bytes": mem["argument"],
            **{k: v for k, v in combo.items() if k != "devices"},
        }
        results.append(rec)
        if not args.json:
            extra = " ".join(f"{k}={v}" for k, v in combo.items())
            print(
                f"{name:14s} {extra:24s} compile {compile_s:7.2f}s  step {med * 1e3:8.1f} ms "
                f"[{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}]  {tokens / med:10.0f} tok/s  "
                f"peak {peak_bytes / 2**20:8.1f} MiB  state+batch {mem['argument'] / 2**20:7.2f} MiB",
                flush=True,
            )
    return results


def _report(args, sweeps, results: list[dict], devices_all: list) -> None:
    """The JSON document (--json) and the plot against the first sweep key (--plot)."""

    doc = {
        "config": args.config,
        "devices": jax.device_count(),
        "backend": jax.default_backend(),
        "device_kind": devices_all[0].device_kind,
        "steps": args.steps,
        "overrides": args.overrides,
        "sweeps": {k: v for k, v in sweeps},
        "results": results,
    }
    if args.json:
        print(json.dumps(doc))
    if args.plot and sweeps:
        plot(doc, sweeps[0][0], args.plot)
