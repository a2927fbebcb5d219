"""Exposed collectives of the train step compiled for a GPU target, per set of XLA compile
options (BENCHMARKS.md, "Issue 26: ... exposed collectives on jax 0.12").

    python benchmarks/exposed_collectives.py --config configs/llama2_7b.yaml --strategy full_shard \
        --variant now='{}' \
        --variant one_in_flight='{"xla_gpu_experimental_parallel_collective_overlap_limit": 1}'
    python benchmarks/exposed_collectives.py --config configs/llama2_70b.yaml --hosts 8 ...

One JSON line per variant: peak and temp (GB per device), the collectives the step waits for
(parameter-sized, at least --min-bytes: synchronous, or async with nothing scheduled between
start and done; from `fsdp_jax.hlo.schedule.collective_schedule`), their share of the step's collective
bytes, and the compile time. Each variant is one XLA:GPU compile in a child process that sees
the CUDA compile-only plugin (`python -m fsdp_jax.targets install`). Variant options are added
to the step's own (`fsdp_jax.targets.xla_flags.STEP_OPTIONS_GPU`); '{}' is the step as it compiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = r"""
import json, sys
from fsdp_jax.targets import gpu as targets
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.app.planner.one_strategy import plan_strategy
from fsdp_jax.app.planner.abstract_step import target_mesh_sizes
req = json.loads(sys.stdin.read())
if req["device_memory"]:  # a hypothetical chip: the target's spec with more device memory
    import re
    _spec = targets.target_config
    targets.target_config = lambda name: re.sub(
        r"device_memory_size: \d+", f"device_memory_size: {req['device_memory']}", _spec(name))
cfg = load_run_config(req["config"], req["overrides"])
devs = targets.gpu_devices(req["target"], req["hosts"], req["per_host"])
for name, opts in req["variants"].items():
    r = plan_strategy(cfg, req["strategy"], devs, inspect=True, compiler_options=opts or None,
                      mesh_sizes=target_mesh_sizes(cfg, req["strategy"], len(devs), req["hosts"]))
    coll = [c for c in r["schedule"] if c["op"] in ("all-gather", "reduce-scatter", "all-reduce")]
    total = sum(c["bytes_per_step"] for c in coll)
    exposed = [c for c in coll if c["bytes"] >= req["min_bytes"]
               and (not c["async"] or not (c["overlap"] or {}).get("ops"))]
    print(json.dumps({
        "variant": name, "options": opts, "peak_GB": round(r["compiled"]["peak"] / 1e9, 3),
        "temp_GB": round(r["compiled"]["temp"] / 1e9, 3), "collective_GB_per_step": round(total / 1e9, 2),
        "exposed_fraction": round(sum(c["bytes_per_step"] for c in exposed) / total, 4) if total else 0.0,
        "exposed": [{"name": c["name"], "op": c["op"], "phase": c["phase"], "async": c["async"],
                     "bytes": c["bytes"], "runs": c["runs"]} for c in exposed],
        "compile_s": r["compile_s"]}), flush=True)
"""


def main(argv: list[str] | None = None) -> int:
    from fsdp_jax.app.cli.flags import Parser, int_in, real_in

    ap = Parser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--strategy", default="full_shard")
    ap.add_argument("--target", default="h100")
    ap.add_argument("--hosts", type=int_in(1), default=1)
    ap.add_argument("--per-host", type=int_in(1), default=8)
    ap.add_argument("--min-bytes", type=int_in(0), default=1 << 20)
    ap.add_argument(
        "--device-memory-gb",
        type=real_in(0, above=True),
        default=None,
        help="compile for the target with this much device memory instead of its own (an "
        "experiment: XLA's scheduler overlaps collectives only under a memory limit taken from it)",
    )
    ap.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="NAME=JSON",
        help="compile options as a JSON object (repeatable; default: now='{}')",
    )
    ap.add_argument("overrides", nargs="*", help="config overrides, key=value")
    args = ap.parse_args(argv)
    variants = {}
    for v in args.variant or ["now={}"]:
        name, eq, text = v.partition("=")
        try:
            variants[name] = json.loads(text) if eq else None
        except json.JSONDecodeError:
            variants[name] = None
        if not eq or not isinstance(variants[name], dict):
            print(f"error: --variant {v!r}: give NAME=<JSON object of compile options>", file=sys.stderr)
            return 2
    from fsdp_jax.targets import gpu

    req = {
        "config": str(Path(args.config).resolve()),
        "overrides": args.overrides,
        "strategy": args.strategy,
        "target": args.target,
        "hosts": args.hosts,
        "per_host": args.per_host,
        "min_bytes": args.min_bytes,
        "device_memory": int(args.device_memory_gb * 1e9) if args.device_memory_gb else None,
        "variants": variants,
    }
    env = gpu.child_env(
        dict(
            os.environ,
            PYTHONPATH=os.pathsep.join(
                [str(ROOT)] + ([os.environ["PYTHONPATH"]] if os.environ.get("PYTHONPATH") else [])
            ),
        )
    )
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(req),
        text=True,
        env=env,
        cwd=ROOT,
        stderr=subprocess.PIPE,
        check=False,
    )
    if proc.returncode:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode


if __name__ == "__main__":
    sys.exit(main())
