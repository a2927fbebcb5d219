"""Will it fit? Per-device memory of a config under each strategy, analytic and compiled.

    doc = plan_config(cfg, n_devices=8, device_memory=parse_bytes("80GB"))
    print(format_table(doc))

For each strategy the planner builds the train step the trainer builds (the same
model, loss, optimizer, precision, remat and microbatches, from the same builder
functions as `fsdp_jax.app.loop.setup`), but from abstract inputs only
(`ShapeDtypeStruct`s carrying shardings, `fsdp_jax.state.abstract_state`), and
AOT-compiles it: nothing is allocated, so a 7B or 70B model plans on a laptop.
When this process has fewer than N devices, the compile runs in a child process
with N fake CPU devices (`jax_num_cpu_devices=N`). With a GPU target
(`fsdp_jax.targets.Target`: h100, h200, a100 as hosts x GPUs) the child compiles with
XLA:GPU for compile-only devices of that target instead (deviceless AOT; the CUDA
plugin is on that child's path only), and the result also carries the per-collective
schedule (`fsdp_jax.hlo`), its communication volume and the GPU-only warnings. The user's side (parsing sizes and
strategy lists, the scripts' start-up, the warnings' wording, the tables and the plot)
is `fsdp_jax.app.plan_report`, whose public names are importable from here too.

Two sets of numbers, kept apart:

* **analytic**: params, optimizer state and batch from the sharding plan (exact
  shard shapes); grads, gathered params and activations from the formulas below.
* **compiled**: `memory_analysis()` of the compiled step (`fsdp_jax.memory.compiled_memory`):
  argument (params + optimizer state + batch), output, alias (donated), temp
  (everything transient: grads, gathered params, activations, optimizer-update
  scratch) and the peak. Grads never appear as arguments; they live in temp.

Activation formula (reference Llama, bytes per device), with T = tokens per device
per microbatch (global_batch / microbatches / (data x fsdp) x seq_len), c = bytes of
the compute dtype, D = d_model, Q = heads x head_dim, K = kv_heads x head_dim,
F = ffn_dim, H = heads, S = seq_len, L = layers, V = vocab:

* every layer keeps its input (the scan carry), c*D per token, whatever the policy;
* plus what the remat policy saves per token per layer (`saved_per_token`):
  none: c*(3D + 2Q + 2K + 4F) + H*S*(4 + c) (norm outputs, q/k/v, attention output,
  SwiGLU gate/up/silu/product, softmax probabilities in f32 and compute dtype);
  dots: c*(2Q + 2K + 2D + 2F) + 4*H*S (every matmul output, including the f32
  attention logits of `jax.nn.dot_product_attention`'s XLA path, which is the
  S-squared term); dots_no_batch: c*(Q + 2K + 2D + 2F) (projections only);
  save_attn_mlp_out: 2cD; save_qkv_attn_mlp_out: c*(Q + 2K + 2D); full: 0;
* plus one layer's backward working set (its recomputed activations and the f32
  attention-logit gradient), T*(none + 4*H*S);
* plus the head: T*(c*D + V*(c + 4 + 4)) (final norm output, logits, f32
  log-softmax and its gradient).
Small f32 norm statistics, RoPE tables and masks are ignored. Gathered params
(transient full-size copies in the compute dtype): full_shard / hybrid_shard keep
two layers in flight (the one computing, the next one prefetched) plus the largest
unstacked param (embedding or head) plus one layer's unreduced grads in the reduce
dtype; shard_grad_op keeps the whole model, and the backward layer loop stacks the
grads of those gathered params at full size (reduce dtype) before they are reduced;
shard_opt / no_shard hold a compute-dtype copy of the model only when the compute
dtype differs from the param dtype. total = params + optimizer + batch + grads +
gathered + activations: the optimizer update (after the backward pass) runs in place
on the donated state and needs less than the backward pass.

XLA:CPU upcasts bf16 matmuls and collectives to f32 (DESIGN.md), so with bf16
compute a CPU compile's temp is larger than the same program's on GPU/TPU.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

import jax
import numpy as np

from fsdp_jax import axes as ax
from fsdp_jax import rules as rl
from fsdp_jax.hlo import (collective_schedule, communication, involuntary_rematerializations,
                          schedule_warnings)
from fsdp_jax.memory import (collective_report, compiled_memory, shard_bytes, tree_bytes,
                             tree_bytes_per_device)
from fsdp_jax.app.plan_report import (  # noqa: F401  (some only re-exported)
    CLASSIC_NAMES, COMPILED_OVER_ANALYTIC, DEFAULT_REPLICATED_THRESHOLD, STRATEGY_ORDER, PlanError,
    check_inputs, fmt_bytes, format_inspection, format_table, load_planning_config, parse_bytes,
    parse_devices, parse_strategies, plot_plan, replicated_threshold_for, sharding_warnings,
    use_cpu_devices)
from fsdp_jax.precision import Policy
from fsdp_jax.strategy import get_strategy


# ----------------------------------------------------------------------------- the step, abstractly

def mesh_shape(cfg, strategy: str, n_devices: int) -> tuple[int, int, int]:
    """(data, fsdp, tensor) for `strategy` on `n_devices`: the config's mesh, resolved
    exactly as the trainer resolves it (`fsdp_jax.mesh.make_mesh`), for every
    strategy. The planner builds the trainer's step, never a neighbour of it: with
    data=1, hybrid_shard plans what the trainer would run (the fsdp axis over every
    device, like full_shard); set mesh.data > 1 to plan replicas over data.
    `strategy` is accepted for callers that pick a mesh per strategy."""
    from fsdp_jax.mesh import resolve_mesh_shape
    del strategy
    data, fsdp, tensor = resolve_mesh_shape((cfg.mesh.data, cfg.mesh.fsdp, cfg.mesh.tensor), n_devices)
    return data, fsdp, tensor


@dataclasses.dataclass
class StepBuild:
    """One strategy's train step built abstractly, as the trainer would build it."""
    cfg: Any
    strategy: str
    mesh: jax.sharding.Mesh
    model: Any  # fsdp_jax.adapters.ModelFns
    optimizer: Any
    plan: Any  # ShardingPlan
    state: Any  # TrainState of sharded ShapeDtypeStructs
    batch: jax.ShapeDtypeStruct
    step: Any  # CompiledStep
    built: Any  # fsdp_jax.build.Built

    def compile(self, compiler_options: dict[str, Any] | None = None):
        """AOT-compile the step; `compiler_options`: XLA debug options for this compile
        only (e.g. {"xla_gpu_enable_while_loop_double_buffering": "true"})."""
        lowered = self.step.lower(self.state, self.batch)
        if not compiler_options:
            return lowered.compile()
        try:
            return lowered.compile(compiler_options=compiler_options)
        except Exception as e:  # XLA rejects unknown options / values with a generic error type
            if "option" in str(e).lower() or "flag" in str(e).lower():
                raise PlanError(f"--xla-flags: {' '.join(str(e).split())[:300]}") from None
            raise

    def init_state(self, rng: jax.Array):
        """A concrete TrainState in the plan's layout (sharded init: params are created
        shard by shard, never whole on one device), for running the step."""
        return self.built.init_state(rng)


def build_step(cfg, strategy: str | None = None, devices: Sequence[jax.Device] | None = None,
               mesh_sizes: tuple[int, int, int] | None = None, **step_options) -> StepBuild:
    """The trainer's train step for `cfg` under `strategy` on `devices`, from abstract
    inputs: `fsdp_jax.build.build` with the trainer's model, loss, optimizer and step
    options (as `fsdp_jax.app.loop.setup`), minus the state. The replicated-fraction
    check is not enforced here (the planner reports it instead). `step_options` go to
    `make_train_step` on top of the trainer's (e.g. skip_nonfinite=False, to measure
    what the guard costs)."""
    from fsdp_jax.adapters import from_nnx
    from fsdp_jax.app.loop import make_loss_fn
    from fsdp_jax.app.models.llama import Llama
    from fsdp_jax.app.optim import build_optimizer
    from fsdp_jax.build import build
    from fsdp_jax.mesh import make_mesh

    strategy = get_strategy(strategy or cfg.mesh.strategy).name
    devices = list(jax.devices() if devices is None else devices)
    sizes = mesh_sizes or mesh_shape(cfg, strategy, len(devices))
    mesh = make_mesh(*sizes, devices=devices)
    model = from_nnx(lambda rngs: Llama(cfg.model, rngs=rngs, remat=cfg.remat))
    optimizer, _ = build_optimizer(cfg.optimizer, cfg.train.steps)
    built = build(model, optimizer, mesh, strategy, loss_fn=make_loss_fn(model), rules=cfg.mesh.rules,
                  min_shard_size=cfg.mesh.min_shard_size, max_replicated_fraction=None,
                  microbatches=cfg.train.microbatches, clip_norm=cfg.optimizer.clip_norm,
                  precision=cfg.precision, offload=cfg.offload, **step_options)
    batch = jax.ShapeDtypeStruct((cfg.train.global_batch, cfg.data.seq_len + 1), np.int32,
                                 sharding=built.plan.batch)
    return StepBuild(cfg, strategy, mesh, model, optimizer, built.plan, built.abstract_state, batch,
                     built.train_step, built)


# ----------------------------------------------------------------------------- analytic

def saved_per_token(model_cfg, remat: str, seq_len: int, compute_bytes: int) -> int:
    """Bytes one layer keeps per token for the backward pass under `remat`, beyond
    its input (see the module docstring)."""
    c, d, f, h = compute_bytes, model_cfg.d_model, model_cfg.ffn_dim, model_cfg.n_heads
    q = h * model_cfg.head_dim
    k = model_cfg.n_kv_heads * model_cfg.head_dim
    table = {
        "none": c * (3 * d + 2 * q + 2 * k + 4 * f) + h * seq_len * (4 + c),
        "full": 0,
        "dots": c * (2 * q + 2 * k + 2 * d + 2 * f) + 4 * h * seq_len,
        "dots_no_batch": c * (q + 2 * k + 2 * d + 2 * f),
        "save_attn_mlp_out": c * 2 * d,
        "save_qkv_attn_mlp_out": c * (q + 2 * k + 2 * d),
        # offloading policies: what they save rests in host memory, none on the device
        # (host bytes: save_attn_mlp_out, save_qkv_attn_mlp_out, dots_no_batch respectively)
        "offload_attn_mlp_out": 0, "offload_qkv_attn_mlp_out": 0, "offload_dots_no_batch": 0,
    }
    if remat not in table:
        raise PlanError(f"remat: no activation formula for policy {remat!r}; known: {', '.join(table)}")
    return table[remat]


def activation_bytes(model_cfg, remat: str, batch_per_device: int, seq_len: int,
                     compute_dtype="float32") -> dict[str, int]:
    """Activation bytes per device for the reference Llama: `layers` (what the layer
    loop keeps for backward), `working` (one layer's backward), `head` (logits and
    loss), and `total`. `batch_per_device`: sequences per device per microbatch."""
    c = np.dtype(compute_dtype).itemsize
    t = batch_per_device * seq_len
    d, h, v = model_cfg.d_model, model_cfg.n_heads, model_cfg.vocab_size
    layers = model_cfg.n_layers * t * (c * d + saved_per_token(model_cfg, remat, seq_len, c))
    working = t * (saved_per_token(model_cfg, "none", seq_len, c) + 4 * h * seq_len)
    head = t * (c * d + v * (c + 4 + 4))
    return {"layers": layers, "working": working, "head": head, "total": layers + working + head}


def _compute_copy(abstract_params, plan, logical_axes, dtype) -> dict[str, int]:
    """Per-device bytes of params in the compute layout (data/fsdp gathered, tensor
    sharding kept) in `dtype`: `whole` model, one `layer` of the stacked (scanned)
    params, the `largest_unstacked` leaf and all `unstacked` leaves together."""
    rows = rl.explain(abstract_params, plan.mesh, logical_axes, plan.rules, (), 0,
                      allow_unshardable=True)
    names = (jax.tree.leaves(logical_axes, is_leaf=lambda x: x is None or isinstance(x, tuple))
             if logical_axes is not None else [])
    names = names if len(names) == len(rows) else [None] * len(rows)
    item = np.dtype(dtype).itemsize
    out = {"whole": 0, "layer": 0, "largest_unstacked": 0, "unstacked": 0}
    for row, nm in zip(rows, names):
        b = row.bytes_per_device // np.dtype(row.dtype).itemsize * item
        out["whole"] += b
        if nm and nm[0] == ax.LAYERS and row.shape:
            out["layer"] += b // row.shape[0]
        else:
            out["largest_unstacked"] = max(out["largest_unstacked"], b)
            out["unstacked"] += b
    return out


def analytic_memory(build: StepBuild) -> dict[str, int]:
    """Per-device bytes by formula (no compile): params, optimizer (incl. the step
    counter), batch, grads, gathered, activations and total."""
    cfg, plan, st = build.cfg, build.plan, build.state
    policy = Policy.parse(cfg.precision)
    s = plan.strategy
    params = tree_bytes_per_device(st.params)
    optimizer = tree_bytes_per_device(st.opt_state) + tree_bytes_per_device(st.step)
    batch = shard_bytes(build.batch)
    grads = sum(shard_bytes(jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=g))
                for p, g in zip(jax.tree.leaves(st.params), jax.tree.leaves(plan.grads)))
    if cfg.train.microbatches > 1:
        grads *= 2  # the accumulator plus one microbatch's grads
    cc = _compute_copy(st.params, plan, build.model.logical_axes, policy.compute_dtype)
    if s.params and not s.gather_once:  # full_shard, hybrid_shard: per layer
        layer_r = _compute_copy(st.params, plan, build.model.logical_axes, policy.reduce_dtype)["layer"]
        gathered = 2 * cc["layer"] + cc["largest_unstacked"] + layer_r
    elif s.params:  # shard_grad_op: whole model gathered once, and its unreduced grads
        gathered = cc["whole"] + _compute_copy(st.params, plan, build.model.logical_axes,
                                               policy.reduce_dtype)["whole"]
    else:  # shard_opt, no_shard: params already whole; a cast copy if dtypes differ
        gathered = cc["whole"] if policy.compute_dtype != policy.param_dtype else 0
    act = activation_bytes(cfg.model, cfg.remat, _batch_per_device(build), cfg.data.seq_len,
                           policy.compute_dtype)
    out = {"params": params, "grads": grads, "optimizer": optimizer, "gathered": gathered,
           "activations": act["total"], "batch": batch}
    out["total"] = sum(out.values())
    out["states"] = params + grads + optimizer  # the classic table's "total per device"
    out.update(offload_memory(build, out))
    return out


DEVICES_PER_HOST = 8  # for bytes per host: GPUs per node (the planner's fake devices share one)


def offload_memory(build: StepBuild, analytic: dict[str, int]) -> dict[str, int]:
    """Host offload (`cfg.offload`) split of the analytic bytes: `host` (per device: its
    share of the offloaded params / optimizer state, resting in its host's pinned
    memory), `host_per_host` (x DEVICES_PER_HOST) and `device_total`: the total minus
    what rests on the host, plus what comes back transiently: the compute-dtype copy of
    offloaded params (sharded as at rest) for the forward/backward pass, and one
    leaf's params + optimizer state during the update (assumes XLA streams the update
    leaf by leaf; a schedule that fetches all at once needs the full state again)."""
    from fsdp_jax.offload import get_offload
    off = get_offload(build.plan.offload)
    st = build.state
    params = tree_bytes_per_device(st.params)
    opt = tree_bytes_per_device(st.opt_state)
    host = (params if off.params else 0) + (opt if off.opt_state else 0)
    c = np.dtype(Policy.parse(build.cfg.precision).compute_dtype).itemsize
    compute_copy = sum(shard_bytes(x) // x.dtype.itemsize * c for x in jax.tree.leaves(st.params)
                       if np.issubdtype(x.dtype, np.floating)) if off.params else 0
    largest = max((shard_bytes(x) for x in jax.tree.leaves(st.params)), default=0)
    update = int(largest * ((1 if off.params else 0) + (opt / params if off.opt_state and params else 0)))
    from fsdp_jax.offload import transfer_bytes
    moved = transfer_bytes(st, off)
    return {"host": host, "host_per_host": host * DEVICES_PER_HOST,
            "device_total": analytic["total"] - host + compute_copy + update,
            "transfer_per_step": moved["to_device"] + moved["to_host"]}


def activations_by_remat(build: StepBuild) -> dict[str, int]:
    """Analytic activation bytes per device for every remat policy with a formula."""
    cfg = build.cfg
    dtype = Policy.parse(cfg.precision).compute_dtype
    return {name: activation_bytes(cfg.model, name, _batch_per_device(build), cfg.data.seq_len, dtype)["total"]
            for name in ("none", "dots", "dots_no_batch", "save_qkv_attn_mlp_out", "save_attn_mlp_out",
                         "full")}


def _batch_per_device(build: StepBuild) -> int:
    """Sequences per device per microbatch: the batch dim is sharded over data x fsdp."""
    n = build.mesh.shape.get(ax.DATA, 1) * build.mesh.shape.get(ax.FSDP, 1)
    return build.cfg.train.global_batch // build.cfg.train.microbatches // n


# ----------------------------------------------------------------------------- one strategy

def inspect_compiled(plan, compiled, *, logical_axes=None, analytic_total: int | None = None,
                     compute_dtype="float32", replicated_threshold: int | None = None) -> dict[str, Any]:
    """Rows, collectives, compiled memory and warnings for any compiled train step.

    `plan`: the ShardingPlan the step was made with; `compiled`: `step.lower(...).compile()`;
    `logical_axes`: the params' logical names (their `layers` dim marks the scanned
    stack, which enables the hoisted-gather check); `analytic_total`: an estimate to
    hold the compiled peak against. Works for any model: nothing here is Llama-specific.
    """
    mem = compiled_memory(compiled)
    report = collective_report(compiled.as_text())
    mesh = {k: int(v) for k, v in plan.mesh.shape.items()}
    abstract = jax.tree.unflatten(jax.tree.structure(plan.params),
                                  [jax.ShapeDtypeStruct(r.shape, r.dtype) for r in plan.rows])
    layer_gather = None
    if logical_axes is not None:
        # outside the layer loop only unstacked params (embedding, head) should be gathered,
        # in whatever dtype the program moves them (f32 on CPU even under bf16 compute)
        layer_gather = _compute_copy(abstract, plan, logical_axes, "float32")["unstacked"]
    platform = plan.mesh.devices.flat[0].platform
    hosts = [d.process_index for d in plan.mesh.devices.flat]  # partition id -> host
    schedule = collective_schedule(compiled.as_text(), hosts)
    threshold = replicated_threshold_for(sum(r.total_bytes for r in plan.rows), replicated_threshold)
    warnings = sharding_warnings(
        plan.rows, report, plan.strategy.name, mesh, analytic_total=analytic_total,
        compiled_peak=mem["peak"], layer_gather_bytes=layer_gather,
        cpu_upcast=platform == "cpu" and np.dtype(compute_dtype) != np.float32,
        replicated_threshold=threshold)
    if platform != "cpu":  # XLA:CPU never reduce-scatters, upcasts bf16 and runs collectives in sync
        grad_axes = [a for a in plan.strategy.grads if mesh.get(a, 1) > 1]
        # batch axes the grads stay replicated over (HSDP's data axis): all-reduced by design
        replicated = int(np.prod([mesh.get(a, 1) for a in (ax.DATA, ax.FSDP) if a not in plan.strategy.grads]))
        warnings += schedule_warnings(
            schedule, compute_dtype=np.dtype(compute_dtype).name, shards_grads=bool(grad_axes),
            param_bytes_threshold=_param_sized(plan), replicated_group=replicated)
    return {"mesh": mesh, "platform": platform, "rows": [r.as_dict() for r in plan.rows],
            "collectives": report, "compiled": mem, "warnings": warnings,
            "replicated_threshold": threshold, "schedule": schedule}


def _param_sized(plan) -> int:
    """From how many bytes a collective counts as moving parameters / their grads: half
    the smallest sharded leaf (per layer when stacked: 3 or more dims), at least 4 KiB,
    so that norm scales and loss scalars never count."""
    axes_ = set(plan.strategy.params + plan.strategy.opt_state)
    sharded = [r for r in plan.rows if axes_ & set(jax.tree.leaves(tuple(r.spec)))]
    sizes = [r.total_bytes // (r.shape[0] if len(r.shape) > 2 else 1) for r in sharded]
    return max(1 << 12, min(sizes, default=1 << 21) // 2)


def plan_strategy(cfg, strategy: str, devices: Sequence[jax.Device] | None = None, *,
                  inspect: bool = False, replicated_threshold: int | None = None,
                  mesh_sizes: tuple[int, int, int] | None = None,
                  step_options: dict[str, Any] | None = None,
                  compiler_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Build, analyse and AOT-compile one strategy in this process (needs the devices:
    real, fake CPU, or compile-only GPU-target devices from `fsdp_jax.targets`).
    Returns a JSON-able dict: mesh, analytic, compiled, argument_vs_analytic, compile_s,
    collectives_per_step, activations_by_remat, replicated_fraction, warnings; with
    `inspect`, also rows, the full collective report and the per-collective `schedule`
    (`fsdp_jax.hlo.collective_schedule`)."""
    t0 = time.perf_counter()
    b = build_step(cfg, strategy, devices, mesh_sizes, **(step_options or {}))
    analytic = analytic_memory(b)
    compiled = b.compile(compiler_options)
    compile_s = time.perf_counter() - t0
    ins = inspect_compiled(b.plan, compiled, logical_axes=b.model.logical_axes,
                           analytic_total=analytic["total"],
                           compute_dtype=Policy.parse(cfg.precision).compute_dtype,
                           replicated_threshold=replicated_threshold)
    mem = ins["compiled"]
    mem.update(_compiled_host(compiled, mem))
    out: dict[str, Any] = {
        "mesh": ins["mesh"], "analytic": analytic,
        "compiled": {k: mem[k] for k in ("argument", "output", "alias", "temp", "peak", "xla_peak",
                                          "device_argument", "host_argument", "device_peak",
                                          "host_reported")},
        "offload": cfg.offload,
        "argument_vs_analytic": (mem["argument"] / (analytic["params"] + analytic["optimizer"]
                                                    + analytic["batch"])) - 1,
        "compile_s": round(compile_s, 2), "platform": ins["platform"],
        "collectives_per_step": ins["collectives"]["per_step"],
        "communication": communication(ins["schedule"]),
        "activations_by_remat": activations_by_remat(b),
        "warnings": ins["warnings"],
    }
    try:
        out["replicated_fraction"] = rl.check_sufficiently_sharded(
            b.plan.rows, b.plan.strategy.params, b.mesh, cfg.mesh.max_replicated_fraction,
            cfg.mesh.min_replicated_bytes)
    except rl.ShardingError as e:
        out["replicated_fraction"] = None
        out["warnings"].insert(0, f"the trainer would refuse this plan: {e}")
    if inspect:
        out["rows"] = ins["rows"]
        out["collectives"] = ins["collectives"]
        out["replicated_threshold"] = ins["replicated_threshold"]
        out["schedule"] = ins["schedule"]
    return out


def _compiled_host(compiled, mem: dict[str, int]) -> dict[str, int]:
    """Host/device split of a compiled step's memory: `device_argument` / `host_argument`
    from the parameter layouts of the compiled program (host-resident = memory space
    S(5)); `host_reported`: memory_analysis()'s host bytes (argument + temp + output -
    alias; 0 where the backend does not report them, e.g. CPU); `device_peak`: the peak
    without host-resident bytes (on such backends, the peak minus the host arguments)."""
    from fsdp_jax.offload import entry_argument_bytes
    ma = compiled.memory_analysis()
    host = {k: int(getattr(ma, f"host_{k}_size_in_bytes", 0) or 0)
            for k in ("argument", "output", "alias", "temp")}
    reported = host["argument"] + host["output"] - host["alias"] + host["temp"]
    entry = entry_argument_bytes(compiled.as_text())
    device_peak = mem["peak"] if reported else mem["peak"] - entry["host"]
    return {"device_argument": entry["device"], "host_argument": entry["host"],
            "host_reported": reported, "device_peak": device_peak}


# ----------------------------------------------------------------------------- many strategies, any N


def run_strategies(cfg, n_devices: int, strategies: Sequence[str], *, inspect: bool = False,
                   replicated_threshold: int | None = None, target=None,
                   step_options: dict[str, Any] | None = None,
                   compiler_options: dict[str, Any] | None = None) -> dict[str, dict]:
    """`plan_strategy` for each strategy on `n_devices`: in this process when it has
    that many devices, otherwise in a child process with `n_devices` fake CPU devices.
    With `target` (a `fsdp_jax.targets.Target`), always in a child process that
    compiles for that GPU target (the CUDA plugin on its path only: `targets.child_env`)."""
    from fsdp_jax.verify import devices_for
    devices = None if target is not None else devices_for(n_devices)
    if devices is not None:
        return {s: plan_strategy(cfg, s, devices, inspect=inspect, replicated_threshold=replicated_threshold,
                                 step_options=step_options, compiler_options=compiler_options)
                for s in strategies}
    from fsdp_jax.app.config import config_to_dict
    request = {"config": config_to_dict(cfg), "devices": n_devices, "strategies": list(strategies),
               "inspect": inspect, "replicated_threshold": replicated_threshold,
               "step_options": step_options or {}, "compiler_options": compiler_options or {}}
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    where = f"{n_devices} CPU devices"
    if target is not None:
        from fsdp_jax import targets
        env = targets.child_env(env)  # raises PluginMissing (a TargetError) naming the install step
        request["target"] = {"name": target.name, "hosts": target.hosts,
                             "gpus_per_host": target.gpus_per_host}
        where = target.describe()
    proc = subprocess.run([sys.executable, "-m", "fsdp_jax.app.planner"], input=json.dumps(request),
                          capture_output=True, text=True, env=env)
    if proc.returncode == 2:
        raise PlanError(proc.stderr.strip().splitlines()[-1].removeprefix("error: "))
    if proc.returncode != 0:
        raise RuntimeError(f"planner child process ({where}) failed with exit code "
                           f"{proc.returncode}:\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout)
    for name, log in _logs_by_strategy(proc.stderr).items():
        for r in involuntary_rematerializations(log):
            if name in out:
                out[name]["warnings"].append(
                    f"involuntary full rematerialization of {r['tensor']} {r['shape']} (op {r['op_name'] or '?'}): "
                    f"the partitioner could not go from sharding {r['from']} to {r['to']} without "
                    f"materialising the whole tensor on every device; constrain it (or its producer) "
                    f"to a layout that maps onto the target one")
    return out


_STRATEGY_MARK = "fsdp_jax.app.planner: compiling "


def _logs_by_strategy(stderr: str) -> dict[str, str]:
    """The child's stderr (XLA's own log lines included) cut at the marker printed
    before each strategy's compile."""
    out: dict[str, list[str]] = {}
    current = None
    for line in stderr.splitlines():
        if line.startswith(_STRATEGY_MARK):
            current = line[len(_STRATEGY_MARK):].strip()
            out[current] = []
        elif current is not None:
            out[current].append(line)
    return {k: "\n".join(v) for k, v in out.items()}


def target_mesh_sizes(cfg, strategy: str, n_devices: int, hosts: int) -> tuple[int, int, int]:
    """Mesh sizes on a `hosts`-host cluster: `mesh_shape`, except that hybrid_shard on a
    config without its own data axis puts `data` across the hosts and `fsdp` within one
    (HSDP's layout: reduce-scatter over NVLink, a gradient all-reduce across hosts)."""
    data, fsdp, tensor = mesh_shape(cfg, strategy, n_devices)
    if (strategy == "hybrid_shard" and hosts > 1 and cfg.mesh.data in (1, -1)
            and (data * fsdp) % hosts == 0 and data * fsdp // hosts > 1):
        data, fsdp = hosts, data * fsdp // hosts
    return data, fsdp, tensor


def _child_main() -> int:
    """`python -m fsdp_jax.app.planner` < request.json: compile on N fake CPU devices
    (or, with "target", on compile-only GPU devices), print the results as JSON. Set
    up before JAX initialises its backends."""
    req = json.loads(sys.stdin.read())
    target = req.get("target")
    if target is None:
        use_cpu_devices(int(req["devices"]))
    from fsdp_jax.app.cli import BAD_INPUT, fail
    from fsdp_jax.app.config import config_from_dict
    from fsdp_jax.targets import TargetError
    try:
        cfg = config_from_dict(req["config"])
        sizes = {}
        if target is None:
            devices = jax.devices()[:req["devices"]]
        else:
            from fsdp_jax import targets
            devices = targets.gpu_devices(target["name"], target["hosts"], target["gpus_per_host"])
            sizes = {s: target_mesh_sizes(cfg, s, len(devices), target["hosts"]) for s in req["strategies"]}
        out = {}
        for s in req["strategies"]:
            print(_STRATEGY_MARK + s, file=sys.stderr, flush=True)  # XLA logs to the same fd 2
            out[s] = plan_strategy(cfg, s, devices, inspect=req["inspect"],
                                   replicated_threshold=req["replicated_threshold"],
                                   mesh_sizes=sizes.get(s), step_options=req.get("step_options"),
                                   compiler_options=req.get("compiler_options"))
            sys.stderr.flush()
    except BAD_INPUT + (PlanError, TargetError) as e:
        return fail(e)
    json.dump(out, sys.stdout)
    return 0


def plan_config(cfg, n_devices: int, strategies: Sequence[str] | str | None = None, *,
                device_memory: int | None = None, config_name: str = "", target=None) -> dict[str, Any]:
    """The planner's JSON document for `cfg` on `n_devices` (bytes per device, ints):
    {"config", "devices", "params", "param_bytes", "device_memory", "wall_s", "notes",
    "target", "strategies": {name: {"mesh", "analytic": {params, grads, optimizer,
    gathered, activations, batch, states, total}, "compiled": {argument, output, alias,
    temp, peak, xla_peak}, "terms": {argument, temp, peak: compiled / analytic - 1},
    "fits", "headroom", "bytes_per_param", "compile_s", "warnings", ...}}}.
    `fits` and `headroom` use the compiled peak (None without `device_memory`). With
    `target` (`fsdp_jax.targets.Target`) the step is compiled by XLA:GPU for that GPU
    and cluster shape (deviceless), and `device_memory` defaults to the target's."""
    from fsdp_jax.app.models.llama import count_params
    t0 = time.perf_counter()
    names = parse_strategies(strategies)
    check_inputs(cfg, n_devices, names)
    if target is not None and device_memory is None:
        from fsdp_jax.targets import device_memory as target_memory
        device_memory = target_memory(target.name)
    results = run_strategies(cfg, n_devices, names, target=target)
    n_params = count_params(cfg.model)
    policy = Policy.parse(cfg.precision)
    for name, r in results.items():
        r["classic_name"] = CLASSIC_NAMES[name]
        r["bytes_per_param"] = round(r["analytic"]["states"] / n_params, 3)  # per device
        r["terms"] = analytic_vs_compiled(r["analytic"], r["compiled"])
        if device_memory:  # device_peak / device_total: without host-resident (offloaded) bytes
            r["fits"] = r["compiled"]["device_peak"] <= device_memory
            r["headroom"] = device_memory - r["compiled"]["device_peak"]
            r["fits_analytic"] = r["analytic"]["device_total"] <= device_memory
        else:
            r["fits"] = r["headroom"] = r["fits_analytic"] = None
    notes = [f"{n_devices} devices; precision {policy}; remat {cfg.remat}; offload {cfg.offload}; "
             f"global_batch {cfg.train.global_batch} x seq {cfg.data.seq_len}, "
             f"microbatches {cfg.train.microbatches}",
             "analytic params/optimizer/batch come from the sharding plan; grads, gathered and "
             "activations from formulas (fsdp_jax.app.planner docstring); compiled = memory_analysis() "
             "of the AOT-compiled train step (grads live in its temp)"]
    if cfg.offload != "none":
        notes.append(f"offload {cfg.offload}: host = per-device bytes resting in pinned host memory "
                     f"(x{DEVICES_PER_HOST} per host); fits uses device_peak / device_total, which "
                     "leave them out (on CPU the compiled program moves nothing, so its device_peak "
                     "misses the transient device copies the analytic device_total counts)")
    if "hybrid_shard" in results:
        m = results["hybrid_shard"]["mesh"]
        notes.append(f"hybrid_shard uses data={m['data']} x fsdp={m['fsdp']} (params sharded within "
                     f"fsdp, replicated over data)")
    if target is not None:
        notes.insert(0, f"compiled by XLA:GPU for {target.describe()} (deviceless AOT: no GPU used; "
                        f"no autotuning); device memory {device_memory / 1e9:.2f} GB unless given")
    platforms = {r["platform"] for r in results.values()}
    if "cpu" in platforms and policy.compute_dtype != np.dtype("float32"):
        notes.append("compiled on CPU: XLA:CPU upcasts bf16 matmuls and collectives to f32, so "
                     "compiled temp overstates a GPU/TPU compile")
    doc = {"config": config_name, "devices": n_devices, "params": n_params,
           "target": None if target is None else {"name": target.name, "hosts": target.hosts,
                                                  "gpus_per_host": target.gpus_per_host},
           "param_bytes": tree_bytes(_abstract_params(cfg)), "device_memory": device_memory,
           "strategies": results, "notes": notes}
    doc["wall_s"] = round(time.perf_counter() - t0, 1)
    return doc


def analytic_vs_compiled(analytic: dict[str, int], compiled: dict[str, int]) -> dict[str, float]:
    """How far the compiled program is from the analytic model, per term (compiled /
    analytic - 1): `argument` (params + optimizer + batch), `temp` (grads + gathered +
    activations: everything transient) and `peak` (total)."""
    pairs = {"argument": (compiled["argument"], analytic["params"] + analytic["optimizer"] + analytic["batch"]),
             "temp": (compiled["temp"], analytic["grads"] + analytic["gathered"] + analytic["activations"]),
             "peak": (compiled["peak"], analytic["total"])}
    return {k: (c / a - 1 if a else float("nan")) for k, (c, a) in pairs.items()}


def format_offload_table(docs: dict[str, dict[str, Any]]) -> str:
    """Strategy x offload setting: device bytes (analytic device_total, compiled
    device_peak), host bytes per device and per host, and whether it fits."""
    first = next(iter(docs.values()))
    mem = first.get("device_memory")
    lines = [f"offload: bytes per device (analytic device_total / compiled device_peak) and host "
             f"bytes (per device / per host of {DEVICES_PER_HOST})"
             + (f"; fits = analytic and compiled <= {fmt_bytes(mem)}" if mem else "")]
    hdr = (f"{'strategy':<14}{'offload':<18}{'device ana':>11}{'device cmp':>11}{'host/dev':>10}"
           f"{'host/host':>11}{'H<->D/step':>11}{'fits':>9}")
    lines += [hdr, "-" * len(hdr)]
    for name in first["strategies"]:
        for off, doc in docs.items():
            r = doc["strategies"][name]
            a, c = r["analytic"], r["compiled"]
            fits = "-" if r["fits"] is None else (
                f"{'yes' if r['fits_analytic'] else 'NO'}/{'yes' if r['fits'] else 'NO'}")
            lines.append(f"{name:<14}{off:<18}{fmt_bytes(a['device_total']):>11}"
                         f"{fmt_bytes(c['device_peak']):>11}{fmt_bytes(a['host']):>10}"
                         f"{fmt_bytes(a['host_per_host']):>11}{fmt_bytes(a['transfer_per_step']):>11}"
                         f"{fits:>9}")
    if mem and "none" in docs:
        only = [n for n in first["strategies"]
                if not docs["none"]["strategies"][n]["fits_analytic"]
                and any(d["strategies"][n]["fits_analytic"] for o, d in docs.items() if o != "none")]
        lines.append("fits only with offload (analytic): " + (", ".join(only) or "none"))
    return "\n".join(lines)


def _abstract_params(cfg):
    """The master params as the trainer stores them (in the precision's param dtype)."""
    from fsdp_jax.adapters import from_nnx
    from fsdp_jax.app.models.llama import Llama
    from fsdp_jax.build import with_param_dtype
    model = from_nnx(lambda rngs: Llama(cfg.model, rngs=rngs))
    return with_param_dtype(model, Policy.parse(cfg.precision).param_dtype).abstract_params


if __name__ == "__main__":
    sys.exit(_child_main())
