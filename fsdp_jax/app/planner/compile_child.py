"""Many strategies on any number of devices (`run_strategies`): in this process when it
has the devices, otherwise in a child process with N fake CPU devices, or compile-only
devices of a GPU / TPU target. The child is `python -m fsdp_jax.app.planner.estimate`
(its entry point, `child_main`, is here); it reads the request as JSON on stdin and
prints the results as JSON, and its stderr (XLA's own log lines included) is cut per
strategy to find involuntary rematerializations."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import jax

from fsdp_jax.app.config.parse import config_from_dict, config_to_dict
from fsdp_jax.app.devices import use_cpu_devices
from fsdp_jax.app.exits import BAD_INPUT, fail
from fsdp_jax.app.planner.abstract_step import target_mesh_sizes
from fsdp_jax.app.planner.one_strategy import plan_strategy
from fsdp_jax.errors import OffloadError, PlanError, TargetError
from fsdp_jax.hlo.findings import involuntary_rematerializations, rematerialization_warning
from fsdp_jax.targets.gpu import Target, child_env, target_devices
from fsdp_jax.targets.plugins import INSTALL_HINT
from fsdp_jax.targets.xla_flags import UNKNOWN_FLAG, unknown_flag
from fsdp_jax.verify.run import devices_for


def run_strategies(
    cfg,
    n_devices: int,
    strategies: Sequence[str],
    *,
    inspect: bool = False,
    replicated_threshold: int | None = None,
    target=None,
    step_options: dict[str, Any] | None = None,
    compiler_options: dict[str, Any] | None = None,
) -> dict[str, dict]:
    """`plan_strategy` for each strategy on `n_devices`: in this process when it has
    that many devices, otherwise in a child process with `n_devices` fake CPU devices.
    With `target` (a `fsdp_jax.targets.gpu.Target`), always in a child process that
    compiles for that GPU target (the CUDA plugin on its path only: `child_env`)."""

    devices = None if target is not None else devices_for(n_devices)
    if devices is not None:
        return {
            s: plan_strategy(
                cfg,
                s,
                devices,
                inspect=inspect,
                replicated_threshold=replicated_threshold,
                step_options=step_options,
                compiler_options=compiler_options,
            )
            for s in strategies
        }

    request = {
        "config": config_to_dict(cfg),
        "devices": n_devices,
        "strategies": list(strategies),
        "inspect": inspect,
        "replicated_threshold": replicated_threshold,
        "step_options": step_options or {},
        "compiler_options": compiler_options or {},
    }
    proc, where = _run_child(request, n_devices, target)
    if proc.returncode == 2:
        raise PlanError(proc.stderr.strip().splitlines()[-1].removeprefix("error: "))

    unknown = unknown_flag(proc.stderr)
    if unknown:  # XLA aborts the child on a flag this jaxlib does not know: the user's input
        raise PlanError(f"XLA_FLAGS: {UNKNOWN_FLAG}: {unknown} (this jax's XLA does not know it)")
    if proc.returncode != 0:
        raise RuntimeError(
            f"planner child process ({where}) failed with exit code {proc.returncode}:\n{proc.stderr[-4000:]}"
        )
    out = json.loads(proc.stdout)
    _add_rematerialization_warnings(out, proc.stderr)
    return out


def _run_child(request: dict[str, Any], n_devices: int, target) -> tuple[subprocess.CompletedProcess, str]:
    """`python -m fsdp_jax.app.planner.estimate` with `request` on stdin: on `n_devices` fake CPU
    devices, or compile-only devices of `target`. The finished process and where it ran."""
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    where = f"{n_devices} CPU devices"
    scratch_dir = (
        tempfile.TemporaryDirectory(prefix="fsdp_jax-plan-") if target is not None else contextlib.nullcontext()
    )
    with scratch_dir as scratch:
        if target is not None:
            # raises MissingExtra (a TargetError) naming the install step; the strategies
            # compiled in the child reuse each other's GPU kernels (a cache of its own)
            env = child_env(env, kernel_cache=Path(scratch) / "xla_gpu_kernels.bin", target=target)
            request["target"] = target.as_dict()
            where = target.describe()
        proc = subprocess.run(
            [sys.executable, "-m", "fsdp_jax.app.planner.estimate"],
            input=json.dumps(request),
            capture_output=True,
            text=True,
            env=env,
        )
    return proc, where


def _add_rematerialization_warnings(out: dict[str, dict], stderr: str) -> None:
    """A warning on each strategy's result for every involuntary full rematerialization
    XLA logged while compiling it (the child's stderr, cut per strategy)."""
    for name, log in _logs_by_strategy(stderr).items():
        for r in involuntary_rematerializations(log):
            if name in out:
                out[name]["warnings"].append(rematerialization_warning(r))


_STRATEGY_MARK = "fsdp_jax.app.planner.estimate: compiling "


def _logs_by_strategy(stderr: str) -> dict[str, str]:
    """The child's stderr (XLA's own log lines included) cut at the marker printed
    before each strategy's compile."""
    out: dict[str, list[str]] = {}
    current = None
    for line in stderr.splitlines():
        if line.startswith(_STRATEGY_MARK):
            current = line[len(_STRATEGY_MARK) :].strip()
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def child_main() -> int:
    """`python -m fsdp_jax.app.planner.estimate` < request.json: compile on N fake CPU devices
    (or, with "target", on compile-only GPU devices), print the results as JSON. Set
    up before JAX initialises its backends."""
    req = json.loads(sys.stdin.read())
    target = req.get("target")
    if target is None:
        use_cpu_devices(int(req["devices"]))

    try:
        cfg = config_from_dict(req["config"])
        sizes = {}
        if target is None:
            devices = jax.devices()[: req["devices"]]
        else:
            t = Target(**target)
            devices = target_devices(t)
            sizes = {s: target_mesh_sizes(cfg, s, len(devices), t.hosts) for s in req["strategies"]}
        out = {}
        for s in req["strategies"]:
            print(_STRATEGY_MARK + s, file=sys.stderr, flush=True)  # XLA logs to the same fd 2
            out[s] = plan_strategy(
                cfg,
                s,
                devices,
                inspect=req["inspect"],
                replicated_threshold=req["replicated_threshold"],
                mesh_sizes=sizes.get(s),
                step_options=req.get("step_options"),
                compiler_options=req.get("compiler_options"),
            )
            sys.stderr.flush()
    except BAD_INPUT + (PlanError, TargetError) as e:
        return fail(e)
    except OffloadError as e:  # compile-only GPU devices plan it (target_offload); others refuse
        if target is None:
            raise
        return fail(
            TargetError(
                f"{e} (compile-only {target['name']} devices offer no pinned_host memory kind: plan --offload "
                f"without --target)"
            )
        )
    except RuntimeError as e:
        if target is None or "cuDNN" not in str(e):
            raise
        return fail(
            TargetError(
                f"model.attention=cudnn: NVIDIA's cuDNN library is not in the compile folder ({e}); install it with "
                f"`{INSTALL_HINT}` (it adds NVIDIA's cuDNN wheel next to the CUDA plugin)"
            )
        )
    json.dump(out, sys.stdout)
    return 0
