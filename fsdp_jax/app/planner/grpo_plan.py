"""Planning a GRPO step (`objective: grpo`): the generation on the training mesh and the
training step, their peaks and, on a target, their time.

A GRPO step (one generation batch) is: the policy samples `max_new_tokens` after each of
the batch's prompts (`fsdp_jax.app.models.generate`: one `prefill`, then one `decode_step`
per token, the params in their training layout, gathered per layer inside the layer scan),
the rewards score the completions on the host, then `num_iterations` optimizer steps train
on the batch (`fsdp_jax.app.objectives.grpo_loss`). The planner compiles the training step
as the trainer builds it (`abstract_step.build_step`, batch `abstract_grpo_batch`, rows of
prompt + completion tokens: `row_cfg`) and, on the same mesh, the two generation programs
alone (`generation_programs`), from abstract inputs.

Memory (`plan_generation`, bytes per device):
- `kv_cache`: the cache's shard, (L, B, P + N, K, Dh) in the compute dtype with its batch
  dim over data x fsdp (`models/kv_cache.py`), the memory model's term (`cache_bytes`);
- `prefill` / `decode_step`: each compiled program's memory_analysis (its arguments are the
  params and, for a decode step, the cache, donated and updated in place);
- `resident`: what stays on the device during generation without being an argument: the
  optimizer state and model state (the frozen reference when beta > 0);
- `peak` = max(prefill, decode step) + resident. The step's peak is the larger of it and the
  training step's.

Time (`grpo_split`, on a target, each program op by op as `step_time.predict_ops`):
generation = prefill + max_new_tokens x decode step (every row running to max_new_tokens:
the worst case the step must budget; a row that stops early still runs, the loop ends when
all have stopped); training = num_iterations x the training step; with num_iterations > 1
the sampling policy's log-probs are one more forward, not counted. The rewards (host
processes) are not in it.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import jax
import numpy as np
from flax import linen as nn
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.app.models.generate import SamplingSpec, decode_step, prefill
from fsdp_jax.app.models.kv_cache import CACHE_AXES, cache_bytes
from fsdp_jax.app.objectives.grpo_run import grpo_spec, is_grpo, stop_tokens
from fsdp_jax.app.planner.op_costs import simulate
from fsdp_jax.hlo.costs import op_inventory
from fsdp_jax.hlo.memory import compiled_memory, state_bytes_per_device
from fsdp_jax.sharding import rules
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.targets.compile_cache import compile_lowered
from fsdp_jax.targets.gpu import dcn_groups
from fsdp_jax.targets.perf_tables import perf_table
from fsdp_jax.train.step import sharding_context


def row_cfg(cfg):
    """`cfg` with data.seq_len = the tokens a GRPO row feeds the model (prompt + completion:
    `grpo_loss.policy_logits`), so the memory model and the step-time model count the
    training step's rows; unchanged for other objectives."""
    if not is_grpo(cfg):
        return cfg
    s = cfg.grpo.max_prompt_len + cfg.grpo.max_new_tokens
    return dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, seq_len=s))


def abstract_grpo_batch(cfg, sharding) -> dict[str, jax.ShapeDtypeStruct]:
    """The GRPO training batch (`GrpoBatches.batch`) as ShapeDtypeStructs with `sharding`."""
    b, p, n = cfg.train.global_batch, cfg.grpo.max_prompt_len, cfg.grpo.max_new_tokens
    shapes = {
        "tokens": ((b, p + n), np.int32),
        "prompt_len": ((b,), np.int32),
        "completion": ((b, n), np.int32),
        "completion_mask": ((b, n), np.int32),
        "advantages": ((b,), np.float32),
    }
    if cfg.grpo.num_iterations > 1:
        shapes["old_logps"] = ((b, n), np.float32)
    return {k: jax.ShapeDtypeStruct(s, dt, sharding=sharding) for k, (s, dt) in shapes.items()}


def cache_sharding(plan) -> NamedSharding:
    """The KV cache's layout under `plan`'s rules (`kv_cache.CACHE_AXES`)."""
    spec = nn.logical_to_mesh_axes(CACHE_AXES, rules.flax_rules(plan.rules))
    return NamedSharding(plan.mesh, P(*spec))


def generation_programs(build, params=None) -> dict[str, Any]:
    """{"prefill", "decode_step"}: jax `Lowered`s of the generation's two programs for the
    `build` (an `abstract_step.StepBuild` of a GRPO config), on its mesh, from abstract inputs:
    prefill(params, prompts (B, P), lengths (B,)) -> (last logits, cache) and
    decode_step(params, last, cache (donated), index, start, done, key) -> (token, last, cache).
    `params`: abstract params in another layout (default: the training layout, `build.state.params`;
    benchmarks/grpo_decode_layout.py compares a replicated compute-dtype copy)."""
    cfg, plan = build.cfg, build.plan
    g = cfg.grpo
    spec = grpo_spec(cfg)
    rows, p, n = cfg.train.global_batch, g.max_prompt_len, g.max_new_tokens
    policy = Policy.parse(cfg.precision)
    sampling = SamplingSpec(n, spec.temperature, spec.top_p, spec.top_k, stop_tokens(cfg), 0)
    model = build.model
    c_sh, rep = cache_sharding(plan), NamedSharding(plan.mesh, P())
    m = cfg.model
    cache_shape = (m.n_layers, rows, p + n, m.n_kv_heads, m.head_dim)
    cache = {
        k: jax.ShapeDtypeStruct(cache_shape, policy.compute_dtype, sharding=c_sh) for k in ("k", "v")
    }  # as kv_cache.init_cache
    params = build.state.params if params is None else params

    def prefill_fn(params, prompts, lengths):
        return prefill(model.bind(policy.cast_to_compute(params)), prompts, lengths, n)

    def decode_fn(params, last, cache, index, start, done, key):
        bound = model.bind(policy.cast_to_compute(params))
        return decode_step(bound, last, cache, index, start, done, key, sampling)

    def arg(shape, dt, sh=plan.batch):
        return jax.ShapeDtypeStruct(shape, dt, sharding=sh)

    key = jax.eval_shape(lambda: jax.random.key(0))
    key = jax.ShapeDtypeStruct(key.shape, key.dtype, sharding=rep)
    last = arg((rows, m.vocab_size), np.float32)
    pre = jax.jit(prefill_fn, out_shardings=(plan.batch, {"k": c_sh, "v": c_sh}))
    dec = jax.jit(decode_fn, out_shardings=(plan.batch, plan.batch, {"k": c_sh, "v": c_sh}), donate_argnums=(2,))
    with sharding_context(plan), jax.default_device(plan.mesh.devices.flat[0]):
        return {
            "prefill": pre.lower(params, arg((rows, p), np.int32), arg((rows,), np.int32)),
            "decode_step": dec.lower(
                params, last, cache, arg((), np.int32, rep), arg((rows,), np.int32), arg((rows,), np.bool_), key
            ),
        }


def plan_generation(build, compiler_options: dict[str, Any] | None = None, ops: bool = False) -> dict[str, Any]:
    """The generation's memory per device (module docstring) for a GRPO `build`, each
    program's compiled memory and compile seconds; with `ops`, each program's `op_inventory`
    (for `grpo_split`)."""
    cfg = build.cfg
    g = cfg.grpo
    rows = cfg.train.global_batch
    policy = Policy.parse(cfg.precision)
    sh = cache_sharding(build.plan)
    shard_rows = sh.shard_shape((cfg.model.n_layers, rows, 1, cfg.model.n_kv_heads, cfg.model.head_dim))
    kv_heads_share = shard_rows[3] / cfg.model.n_kv_heads
    kv = cache_bytes(cfg.model, shard_rows[1], g.max_prompt_len + g.max_new_tokens, policy.compute_dtype.itemsize)
    state = state_bytes_per_device(build.state)
    out: dict[str, Any] = {
        "rows": rows,
        "devices": int(build.mesh.devices.size),
        "prompt_len": g.max_prompt_len,
        "new_tokens": g.max_new_tokens,
        "kv_cache": int(kv * kv_heads_share),
        "resident": state["total"] - state["params"],
    }
    for name, lowered in generation_programs(build).items():
        t0 = time.perf_counter()
        compiled = compile_lowered(lowered, build.mesh.devices.flat, compiler_options)
        mem = compiled_memory(compiled)
        out[name] = {k: mem[k] for k in ("argument", "output", "alias", "temp", "peak")}
        out[name]["compile_s"] = round(time.perf_counter() - t0, 2)
        if ops:
            devices = list(build.mesh.devices.flat)
            out[name]["op_inventory"] = op_inventory(compiled.as_text(), dcn_groups(devices))
    out["peak"] = max(out["prefill"]["peak"], out["decode_step"]["peak"]) + out["resident"]
    return out


def grpo_split(cfg, target: str, generation: dict[str, Any], train_step_s: float | None) -> dict[str, Any] | None:
    """The GRPO step's predicted seconds on `target` (module docstring): prefill, decode step,
    generation, training, their sum and the fractions; None without the programs' ops, or
    where the op model has no figures for a collective."""
    if train_step_s is None or "op_inventory" not in generation.get("decode_step", {}):
        return None
    try:
        table = perf_table(target)
        pre = simulate(generation["prefill"]["op_inventory"], table)["step_s"]
        dec = simulate(generation["decode_step"]["op_inventory"], table)["step_s"]
    except ValueError:
        return None
    n, iters = cfg.grpo.max_new_tokens, cfg.grpo.num_iterations
    gen = pre + n * dec
    train = iters * train_step_s
    total = gen + train
    g = lambda x: float(f"{x:.4g}")  # noqa: E731
    return {
        "prefill_s": g(pre),
        "decode_step_s": g(dec),
        "generation_s": g(gen),
        "training_s": g(train),
        "step_s": g(total),
        "generation_fraction": g(gen / total),
        "training_fraction": g(train / total),
        "decode_tokens_per_s_per_gpu": g(cfg.train.global_batch * n / gen / generation["devices"]),
    }


def format_grpo(doc: dict[str, Any], gb) -> list[str]:
    """The plan table's GRPO lines (empty for other objectives): per strategy the KV cache,
    each generation program's compiled peak, what stays resident, the generation's and the
    training step's peaks; on a target, the predicted split. `gb` formats bytes."""
    rows = [(n, r) for n, r in doc["strategies"].items() if "grpo" in r]
    if not rows:
        return []
    g0 = rows[0][1]["grpo"]
    lines = [
        "",
        f"GRPO step: generation of {g0['new_tokens']} tokens after {g0['prompt_len']}-token prompts for "
        f"{g0['rows']} rows on the training mesh (KV cache in the compute dtype), then the training step "
        "(fsdp_jax.app.planner.grpo_plan; peaks compiled, gen peak = max(prefill, decode) + resident):",
    ]
    hdr = (
        f"{'strategy':<14}{'KV cache':>9}{'prefill':>9}{'decode':>9}{'resident':>9}{'gen peak':>9}"
        f"{'train':>9}{'peak':>9}"
    )
    lines += [hdr, "-" * len(hdr)]
    for n, r in rows:
        g = r["grpo"]
        lines.append(
            f"{n:<14}{gb(g['kv_cache'])}{gb(g['prefill']['peak'])}{gb(g['decode_step']['peak'])}"
            f"{gb(g['resident'])}{gb(g['peak'])}{gb(r['compiled']['device_peak'])}"
            f"{gb(g.get('step_peak', max(g['peak'], r['compiled']['device_peak'])))}"
        )
    split = [(n, r["predicted"]["grpo"]) for n, r in rows if (r.get("predicted") or {}).get("grpo")]
    if split:
        lines += [
            "",
            "predicted GRPO step (op by op; generation = prefill + new tokens x decode step, every row to the "
            "end; training = num_iterations x train step; rewards not counted):",
        ]
        hdr = (
            f"{'strategy':<14}{'prefill s':>10}{'decode s':>10}{'gen s':>9}{'train s':>9}{'step s':>9}"
            f"{'gen %':>7}{'decode tok/s/dev':>18}"
        )
        lines += [hdr, "-" * len(hdr)]
        for n, p in split:
            lines.append(
                f"{n:<14}{p['prefill_s']:10.4f}{p['decode_step_s']:10.5f}{p['generation_s']:9.2f}"
                f"{p['training_s']:9.2f}{p['step_s']:9.2f}{p['generation_fraction']:7.1%}"
                f"{p['decode_tokens_per_s_per_gpu']:18,.0f}"
            )
    return lines
