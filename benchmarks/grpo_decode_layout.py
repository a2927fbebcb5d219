#!/usr/bin/env python
"""The GRPO decode step in two param layouts, planned for a GPU target (issue 58, items 1 and 6).

    PYTHONPATH=. python benchmarks/grpo_decode_layout.py [--config configs/llama3_1_8b_grpo.yaml]
        [--target h100] [--devices 8]

Compiles (deviceless XLA:GPU, nothing runs on a GPU) the config's decode step
(`fsdp_jax.app.models.generate.decode_step`, as `fsdp_jax.app.planner.grpo_plan` does) twice
on the full_shard mesh: with the params in their training layout (f32 shards, cast and
gathered per layer inside the layer scan, what the trainer runs) and in a decode layout (the
whole model replicated in the compute dtype on every device, gathered once per generation,
not per token). Prints one JSON line per layout: the compiled peak, the params' bytes per
device, the op model's decode-step seconds and its breakdown (`fsdp_jax.app.planner.op_costs`).
Re-runs itself in a child process with the target's compile-only devices.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

ap = argparse.ArgumentParser(description=__doc__.splitlines()[1])
ap.add_argument("--config", default="configs/llama3_1_8b_grpo.yaml")
ap.add_argument("--target", default="h100")
ap.add_argument("--devices", type=int, default=8)
args = ap.parse_args()

if not os.environ.get("GRPO_DECODE_LAYOUT_CHILD"):
    from fsdp_jax.targets.gpu import child_env

    env = child_env(dict(os.environ, GRPO_DECODE_LAYOUT_CHILD="1"))
    sys.exit(subprocess.run([sys.executable, *sys.argv], env=env, check=False).returncode)

import jax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

from fsdp_jax.app.planner.abstract_step import build_step  # noqa: E402
from fsdp_jax.app.planner.grpo_plan import generation_programs  # noqa: E402
from fsdp_jax.app.planner.op_costs import simulate  # noqa: E402
from fsdp_jax.app.trainer.setup import load_run_config  # noqa: E402
from fsdp_jax.hlo.costs import op_inventory  # noqa: E402
from fsdp_jax.hlo.memory import compiled_memory, tree_bytes_per_device  # noqa: E402
from fsdp_jax.sharding.precision import Policy  # noqa: E402
from fsdp_jax.targets.gpu import dcn_groups, make_target, target_devices  # noqa: E402
from fsdp_jax.targets.perf_tables import perf_table  # noqa: E402

target = make_target(args.target, devices=args.devices)
devices = target_devices(target)
cfg = load_run_config(args.config, [])
build = build_step(cfg, "full_shard", devices)
compute = Policy.parse(cfg.precision).compute_dtype
rep = NamedSharding(build.mesh, P())
layouts = {
    "training (f32 shards, gathered per layer per token)": build.state.params,
    "decode (compute dtype, replicated)": jax.tree.map(
        lambda a: jax.ShapeDtypeStruct(a.shape, compute, sharding=rep), build.state.params
    ),
}
for name, params in layouts.items():
    lowered = generation_programs(build, params=params)["decode_step"]
    compiled = lowered.compile()
    mem = compiled_memory(compiled)
    sim = simulate(op_inventory(compiled.as_text(), dcn_groups(devices)), perf_table(target.table))
    row = {
        "layout": name,
        "params_per_device": tree_bytes_per_device(params),
        "decode_peak": mem["peak"],
        "decode_step_s": round(sim["step_s"], 5),
        "breakdown": {k: round(v, 5) for k, v in sim["breakdown"].items()},
        "new_tokens": cfg.grpo.max_new_tokens,
        "generation_decode_s": round(sim["step_s"] * cfg.grpo.max_new_tokens, 2),
    }
    print(json.dumps(row), flush=True)
