"""Measure compile time, step time, tokens/s, MFU and peak memory per strategy.

    fsdp-jax benchmark --config configs/tiny.yaml [--strategies full_shard,no_shard]
        [--steps 10] [--warmup 2] [--sweep model.n_layers=4,8,16,32] [--sweep devices=1,2,4,8]
        [--baselines] [--peak-tflops T] [--json] [--plot sweep.png] [key=value ...]

(`python scripts/benchmark.py ...` is the same command; the runners are
`fsdp_jax.app.planner.benchmark`.) Inputs are random tokens (no data set needed). `--baselines` adds two reference
rows at the same global batch: the same model on one device (`single_device`) and
a plain hand-written JAX data-parallel loop (`plain_dp`: replicated params, batch
sharded, `jax.jit` + `jax.value_and_grad` + optax, no fsdp_jax code in the step).
The sweep key `devices` runs on the first N devices. The persistent compilation
cache is off, so compile times are real. On CPU the process gets
FSDP_JAX_CPU_DEVICES (default 8) host devices. Exit codes: 0, 2 bad input, 1 other.
"""

from __future__ import annotations

import json
import statistics

import jax

from fsdp_jax.app.cli.args import add_config, check_out_file, require
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in, real_in
from fsdp_jax.app.config.checks import check_backend, validate
from fsdp_jax.app.devices import use_cpu_devices
from fsdp_jax.app.models.decoder import flops_per_token
from fsdp_jax.app.planner.benchmark import bench_fsdp, bench_plain_dp, combos, parse_sweeps, plot
from fsdp_jax.app.planner.step_time import reference_flops_per_token, step_rows
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.errors import ConfigError, UsageError, one_line
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.strategy import get_strategy
from fsdp_jax.targets.perf import mfu, peak_flops


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, example="model.n_layers=4")
    ap.add_argument("--strategies", default="full_shard,shard_grad_op,shard_opt,no_shard,hybrid_shard")
    ap.add_argument("--steps", type=int_in(1), default=10)
    ap.add_argument("--warmup", type=int_in(0), default=2)
    ap.add_argument("--sweep", action="append", default=[], help="KEY=V1,V2 (repeatable)")
    ap.add_argument("--baselines", action="store_true", help="add single_device and plain_dp rows")
    ap.add_argument("--peak-tflops", type=real_in(0, above=True), default=None, help="peak TFLOP/s per device for MFU")
    ap.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    ap.add_argument("--plot", help="PNG of step time / compile time / memory against the first sweep key")
    return ap


def run(args) -> int:
    """Check every input (flags, then the config of each sweep point), then measure each
    point's rows and report them."""

    use_cpu_devices()
    sweeps, strategies = _parse_flags(args)
    jax.config.update("jax_enable_compilation_cache", False)  # inputs checked: time cold compiles
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


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), run, argv)
