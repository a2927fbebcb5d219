"""Does my model train the same under every strategy? One call, before renting a cluster.

    report = fsdp_jax.verify.run(model, optax.adamw(1e-3), loss_fn, batch, devices=8, steps=3)
    print(report.format()); assert report.passed

`verify` trains `steps` steps on ONE device (the reference) and the same steps under each
strategy on `devices` devices, from the same initial params and the same batches, all
through `fsdp_jax.train.build.build` (the road the trainer and `shard_model` take). Per
strategy it reports the relative loss difference at every step, the relative grad-norm
difference, the parameter difference after every step (per leaf), the state bytes per
device and the collectives per step of the compiled step (`fsdp_jax.hlo.memory`), and
passes or fails against a `Tolerance` chosen from the optimizer and the compute dtype
(`TOLERANCES`, measured: docs/verify.md). A failure names the first step at
which anything diverged, and the leaves that diverged there, worst first.

What it catches: anything whose result depends on how many devices hold the batch or
the params: a `shard_map` block that forgets a cross-device `psum`, `psum` where
`pmean` was meant, per-device randomness (the same dropout key on every shard), a
custom op or constraint that is wrong under one layout. What it cannot see: bugs
that also break the one-device run (it compares, it does not judge the model), and
effects that need more steps than it runs.

Devices. The N devices must exist in the process that runs the comparison. When this
process has fewer, pass the model as a `"module:function"` factory spec instead of
objects: `verify` then runs in a child process started with N fake CPU devices, where
`module.function(**factory_kwargs)` returns a dict of `verify`'s arguments (`model`,
`optimizer`, `loss_fn`, `batch` or `batches`, and any options). The module must be
importable there (the child gets this process's `sys.path`); objects cannot cross the
process boundary, so with objects and too few devices `verify` raises `VerifyError`.
This module is the entry point (input checks, the child process); the comparison itself is
`fsdp_jax.verify.compare`, its report and tolerances `fsdp_jax.verify.report`.
"""

from __future__ import annotations

import dataclasses
import importlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import optax

from fsdp_jax.errors import VerifyError, one_line
from fsdp_jax.sharding import rules
from fsdp_jax.sharding.strategy import STRATEGIES, get_strategy
from fsdp_jax.verify.compare import compare_runs
from fsdp_jax.verify.report import Tolerance, VerifyReport

DEFAULT_STRATEGIES = ("no_shard", "shard_opt", "shard_grad_op", "full_shard", "hybrid_shard")


# ----------------------------------------------------------------------------- entry point


def verify(
    model: Any,
    optimizer: optax.GradientTransformation | None = None,
    loss_fn=None,
    batch: Any = None,
    *,
    strategies: Sequence[str] | None = None,
    devices: int = 8,
    steps: int = 3,
    batches: Sequence[Any] | None = None,
    seed: int = 0,
    tolerance: Tolerance | str | None = None,
    check_init: bool = True,
    in_subprocess: bool | None = None,
    factory_kwargs: Mapping[str, Any] | None = None,
    **options,
) -> VerifyReport:
    """Train `steps` steps on one device and under each strategy on `devices` devices;
    compare.

    `model`: anything `fsdp_jax.shard_model` accepts (a `from_nnx` / `from_linen`
    ModelFns, an init function, an `nnx.Module`, a params tree), or a
    `"module:function"` factory spec (module docstring). `loss_fn(params, batch)`:
    a scalar mean loss. `batch`: one pytree batch with a leading global-batch dim
    divisible by `devices` (used for every step), or `batches`: one per step.
    `strategies`: names or aliases (default: all five). `seed`: init rng.
    `tolerance`: a Tolerance, a `TOLERANCES` name, or None (from the optimizer and
    `precision`). `check_init`: also run each strategy's own sharded init and report
    how far it is from the one-device init (`init_max_abs_diff`; one compile per
    strategy; training starts from the one-device init either way). `in_subprocess`:
    None runs in this process when it has `devices` devices, else in a child
    (factory specs only); True forces the child.
    `options`: `precision`, `microbatches`, `clip_norm`, `remat`, `has_aux`,
    `trainable` (the train step's), `min_shard_size`, `max_replicated_fraction`
    (default None: not checked), `rules`, `logical_axes` (the plan's), `context` (> 1:
    each strategy's mesh splits sequences over a `context` axis of that size, the batch
    divisible by devices / context; the loss must zig-zag its rows, as the trainer's does),
    `data` (> 1: every strategy's mesh is data x fsdp = devices / context / data, e.g. for
    `rules` that split experts over data or fsdp; default 1: fsdp only, hybrid_shard 2 x n/2),
    `routing` (with `has_aux`: an aux key of discrete choices, e.g. an MoE router's
    per-expert load, compared exactly: from a step where a strategy's differs, a routing
    flip, its steps are reported, not judged; a difference at step 1 fails), `post_update` (the
    train step's rule after the update, e.g. DeepSeek-V3's bias rule; objects only), `exact` (a
    leaf name: those leaves must equal the reference's bit for bit after every judged step, e.g.
    `score_bias`, which that rule moves in steps of +-u; reported per step as `exact_diff`).

    Returns a VerifyReport; raises VerifyError on bad input.
    """
    if devices < 1 or steps < 1:
        raise VerifyError(f"verify: devices ({devices}) and steps ({steps}) must be >= 1")
    names = _strategy_names(strategies)
    factory = model if isinstance(model, str) else None
    have = devices_for(devices)
    if in_subprocess or (have is None and factory is not None):
        if factory is None:
            raise VerifyError(
                "verify: in_subprocess=True needs the model as a 'module:function' "
                "factory spec (objects cannot cross into the child process)"
            )
        opts = dict(options, check_init=check_init)
        return _run_child(factory, dict(factory_kwargs or {}), names, devices, steps, seed, tolerance, opts)
    if have is None:
        raise VerifyError(
            f"verify: this process has {len(jax.devices())} {jax.default_backend()} device(s), fewer "
            f"than devices={devices}; start it with {devices} devices (jax.config.update("
            f"'jax_num_cpu_devices', {devices}) before JAX starts) or pass the model as a "
            "'module:function' factory spec, which runs in a child process with that many CPU devices"
        )
    if factory is not None:
        kwargs = _call_factory(factory, factory_kwargs)
        kwargs.update(options)  # the caller's options win over the factory's
        model = kwargs.pop("model")
        optimizer, loss_fn = kwargs.pop("optimizer"), kwargs.pop("loss_fn")
        batch, batches = kwargs.pop("batch", batch), kwargs.pop("batches", batches)
        options = kwargs
    if optimizer is None or loss_fn is None or (batch is None and batches is None):
        raise VerifyError("verify: needs model, optimizer, loss_fn and batch (or batches)")
    return compare_runs(
        model, optimizer, loss_fn, batch, batches, names, have, steps, seed, tolerance, check_init, options
    )


def _strategy_names(strategies) -> list[str]:
    if strategies is None:
        return list(DEFAULT_STRATEGIES)
    if isinstance(strategies, str):
        strategies = [s for s in strategies.split(",") if s.strip()]
    out = []
    for s in strategies:
        try:
            name = get_strategy(s).name
        except ValueError as e:
            raise VerifyError(f"verify: strategies: {e}") from None
        if name not in out:
            out.append(name)
    if not out:
        raise VerifyError(f"verify: strategies names no strategy; choose from {', '.join(STRATEGIES)}")
    return out


def devices_for(n: int) -> list[jax.Device] | None:
    """n devices of one platform in this process (the default backend's first, then
    CPU), or None."""
    if len(jax.devices()) >= n:
        return list(jax.devices())[:n]
    try:
        cpu = jax.devices("cpu")
    except RuntimeError:
        return None
    return list(cpu)[:n] if len(cpu) >= n else None


def _call_factory(spec: str, kwargs: Mapping[str, Any] | None) -> dict:
    mod_name, sep, fn_name = spec.partition(":")
    if not sep or not mod_name or not fn_name:
        raise VerifyError(f"verify: model {spec!r}: a factory spec is 'module:function'")
    try:
        fn = getattr(importlib.import_module(mod_name), fn_name)
    except (ImportError, AttributeError) as e:
        raise VerifyError(f"verify: model {spec!r}: cannot import it: {e}") from None
    out = fn(**dict(kwargs or {}))
    if not isinstance(out, Mapping) or not {"model", "optimizer", "loss_fn"} <= set(out):
        raise VerifyError(
            f"verify: factory {spec} must return a dict with model, optimizer, loss_fn and batch (or batches)"
        )
    return dict(out)


# ----------------------------------------------------------------------------- the child process


def _run_child(
    factory: str, factory_kwargs: dict, names: list[str], devices: int, steps: int, seed: int, tolerance, options: dict
) -> VerifyReport:
    if isinstance(tolerance, Tolerance):
        tolerance = dataclasses.asdict(tolerance)
    request = {
        "factory": factory,
        "factory_kwargs": factory_kwargs,
        "strategies": names,
        "devices": devices,
        "steps": steps,
        "seed": seed,
        "tolerance": tolerance,
        "options": options,
    }
    try:
        text = json.dumps(request)
    except TypeError as e:
        raise VerifyError(
            f"verify: options for the child process must be JSON data ({e}); return the others from the factory"
        ) from None
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
    code = "import sys; from fsdp_jax.verify.run import child_main; sys.exit(child_main())"
    proc = subprocess.run([sys.executable, "-c", code], input=text, capture_output=True, text=True, env=env)
    if proc.returncode == 2:
        raise VerifyError((proc.stderr.strip().splitlines() or ["child failed"])[-1].removeprefix("error: "))
    if proc.returncode != 0:
        raise RuntimeError(
            f"verify child process ({devices} CPU devices) failed with exit code "
            f"{proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    return VerifyReport.from_dict(json.loads(proc.stdout))


def child_main() -> int:
    """stdin: the request JSON; stdout: the report JSON. Exit 2 with one line on bad input."""
    req = json.loads(sys.stdin.read())
    jax.config.update("jax_num_cpu_devices", int(req["devices"]))
    cache = os.environ.get("FSDP_JAX_CACHE_DIR")
    if cache:
        jax.config.update("jax_compilation_cache_dir", cache)
    tol, options = req["tolerance"], dict(req["options"])
    check_init = options.pop("check_init", True)
    try:
        report = verify(
            req["factory"],
            strategies=req["strategies"],
            devices=req["devices"],
            steps=req["steps"],
            seed=req["seed"],
            in_subprocess=False,
            tolerance=Tolerance(**tol) if isinstance(tol, dict) else tol,
            check_init=check_init,
            factory_kwargs=req["factory_kwargs"],
            **options,
        )
    except (VerifyError, rules.ShardingError) as e:
        print("error: " + one_line(e, 4000), file=sys.stderr)
        return 2
    json.dump(report.to_dict(), sys.stdout)
    return 0
