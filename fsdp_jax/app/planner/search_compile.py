"""Compiling a few search candidates: on CPU in this process, for a GPU/TPU target in one
child process whose compiles share one XLA:GPU kernel cache file.

    results = compile_candidates(cfg, 8, cands, make_target("h100", 8), progress=print)

Each result is `fsdp_jax.app.planner.estimate.plan_strategy`'s dict for that candidate's config.
The child reports progress on stderr (lines starting with the module's marker) and writes its
results to a file, so a long compile never blocks on a full pipe.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fsdp_jax.app.config.parse import config_from_dict, config_to_dict
from fsdp_jax.app.exits import BAD_INPUT, fail
from fsdp_jax.app.planner.one_strategy import plan_strategy
from fsdp_jax.app.planner.search_space import candidate_config
from fsdp_jax.errors import PlanError, TargetError
from fsdp_jax.targets.gpu import Target, child_env, target_devices
from fsdp_jax.verify.run import devices_for

_MARK = "fsdp_jax.app.planner.search_compile: "


def _label(c: dict[str, Any]) -> str:
    return (
        f"{c['strategy']} remat={c['remat']} microbatches={c['microbatches']} batch={c['global_batch']}x{c['seq_len']}"
        + (f" attention={c['attention']}" if "attention" in c else "")
    )


def compile_candidates(
    cfg, n_devices: int, cands: list[dict], target, progress: Callable[[str], None], kernel_cache: Path | None = None
) -> list[dict]:
    """`estimate.plan_strategy` results for `cands`: on CPU in this process (it has the
    devices; the persistent compilation cache applies), for a target in one child process
    whose compiles share one XLA:GPU kernel cache file (`kernel_cache`)."""

    if target is None:
        devices, out = devices_for(n_devices), []
        for i, c in enumerate(cands):
            progress(f"[{i + 1}/{len(cands)}] compiling {_label(c)} on {n_devices} CPU devices")
            t0 = time.perf_counter()
            out.append(
                plan_strategy(candidate_config(cfg, c), c["strategy"], devices, mesh_sizes=tuple(c["mesh"].values()))
            )
            progress(f"[{i + 1}/{len(cands)}] done in {time.perf_counter() - t0:.1f} s")
        return out

    with tempfile.TemporaryDirectory(prefix="fsdp_jax-search-") as scratch:
        env = child_env(
            dict(os.environ, JAX_PLATFORMS="cpu"),
            target=target,
            kernel_cache=kernel_cache or Path(scratch) / "xla_gpu_kernels.bin",
        )
        out_file = Path(scratch) / "results.json"
        request = {
            "target": target.as_dict(),
            "out": str(out_file),
            "jobs": [
                {
                    "config": config_to_dict(candidate_config(cfg, c)),
                    "strategy": c["strategy"],
                    "mesh": list(c["mesh"].values()),
                    "label": _label(c),
                }
                for c in cands
            ],
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "fsdp_jax.app.planner.search_compile"],
            stdin=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdout=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        proc.stdin.write(json.dumps(request))
        proc.stdin.close()
        tail: list[str] = []
        for line in proc.stderr:
            if line.startswith(_MARK):
                progress(line[len(_MARK) :].rstrip())
            else:
                tail = (tail + [line.rstrip()])[-60:]
        rc = proc.wait()
        if rc == 2:
            raise PlanError((tail[-1] if tail else "compile child: bad input").removeprefix("error: "))
        if rc != 0:
            raise RuntimeError(
                f"search compile child ({target.describe()}) failed with exit code {rc}:\n" + "\n".join(tail)
            )
        return json.loads(out_file.read_text())


def child_main() -> int:
    """`python -m fsdp_jax.app.planner.search_compile` < request: compile each job for the target in this
    one process (one kernel cache), write the results to request["out"]."""
    req = json.loads(sys.stdin.read())

    try:
        devices = target_devices(Target(**req["target"]))
        out, jobs = [], req["jobs"]
        for i, job in enumerate(jobs):
            print(
                f"{_MARK}[{i + 1}/{len(jobs)}] compiling {job['label']} for {req['target']['name']}",
                file=sys.stderr,
                flush=True,
            )
            t0 = time.perf_counter()
            out.append(
                plan_strategy(config_from_dict(job["config"]), job["strategy"], devices, mesh_sizes=tuple(job["mesh"]))
            )
            print(f"{_MARK}[{i + 1}/{len(jobs)}] done in {time.perf_counter() - t0:.1f} s", file=sys.stderr, flush=True)
    except BAD_INPUT + (PlanError, TargetError) as e:
        return fail(e)
    Path(req["out"]).write_text(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(child_main())
