"""Per-device memory of the trainer's step by formula, without compiling: one concept,
the analytic memory model the planner holds the compiled step against.

    b = build_step(cfg, "full_shard", devices)      # fsdp_jax.app.planner.abstract_step
    analytic_memory(b)   # {params, grads, optimizer, gathered, activations, batch, total, ...}

Params, optimizer state and batch come from the sharding plan (exact shard shapes);
grads, gathered params and activations from the formulas below; `offload_memory`
splits them between device and host for `cfg.offload`.

Activation formula (reference decoder, bytes per device), with T = tokens per device
per microbatch (global_batch / microbatches / (data x fsdp) x seq_len / context: with
`mesh.context` > 1 each sequence is split over the context ranks), c = bytes of
the compute dtype, D = d_model, Q = heads x head_dim, K = kv_heads x head_dim,
F = ffn_dim, H = heads, S = seq_len, L = layers, V = vocab:

* every layer keeps its input (the scan carry), c*D per token, whatever the policy;
* plus what the remat policy's record keeps of the layer's residuals per token
  (`planner/residuals.py`, `saved_per_token`):
  none: c*(3D + 2Q + 2K + 4F) + H*S*(4 + c) (norm outputs, q/k/v, attention output,
  SwiGLU gate/up/silu/product, softmax probabilities in f32 and compute dtype);
  dots: c*(2Q + 2K + 2D + 2F) + 4*H*S (every matmul output, including the f32
  attention logits of `jax.nn.dot_product_attention`'s XLA path, which is the
  S-squared term); dots_no_batch: c*(Q + 2K + 2D + 2F) (projections only);
  save_attn_mlp_out: 2cD; save_qkv_attn_mlp_out: c*(Q + 2K + 2D); full: 0;
* plus one layer's backward working set (its recomputed activations, the f32
  attention-logit gradient and its transposed copy in the compute dtype),
  T*(none + (4 + c)*H*S): with the probabilities in `none`, 8 + 2c bytes a score, the
  ring's rule for its score block (`context_memory`; read from the compiled buffers,
  docs/planning.md "Mixture of experts and context parallelism against the compiled peak");
  with `mesh.context` > 1 planned for XLA:CPU, the larger of the MLP's phase (that) and the
  ring's (the recomputed activations less the MLP's, `mlp_phase_per_token`, plus the ring's working set);
  on the other platforms their sum;
* plus the head: T*(c*D + V*(c + 4 + 4)) (final norm output, logits, f32
  log-softmax and its gradient).
With `attention: cudnn` (flash attention) every S-squared term goes: `none` keeps the f32
softmax statistics (4H) instead of the probabilities, `dots` saves no attention matmul
(the fused kernel's are not dots: c*(Q + 2K + 2D + 2F)), and the working set has no
logit gradient.
With `mesh.context` > 1 the S-squared terms are those of ring / all-gather attention
instead (`fsdp_jax.app.planner.context_memory`: the largest score block, the steps' outputs,
the K/V met, and what `dots` / `none` keep of every step).
A mixture of experts: each sparse layer's router, dispatch and expert terms replace its
dense MLP's, in the saved activations and in the backward working set
(`planner/moe_memory.py`, with XLA:CPU's dense `ragged_dot` lowering on CPU devices).
Small f32 norm statistics, RoPE tables and masks are ignored. Gathered params
(`planner/gathered_memory.py`): full_shard / hybrid_shard keep two layers in flight plus the
largest unstacked param; shard_grad_op the whole model and the layer its backward loop slices
out of the stack; a quantised base (QLoRA) is gathered as its integer codes and scales, and
each strategy adds one layer's weights dequantised in the compute dtype; shard_opt / no_shard
hold a compute-dtype copy of the model only when the compute dtype differs from the param
dtype. Grads (and the unreduced layer grads) are held in `grad_dtype`: the dtype of the dots
that produce them (XLA reduces a weight gradient at its dot, so under bf16 compute they are
reduced and held in bf16 until the update casts them, whatever the reduce dtype; the
GPU-compiled 7B step holds its stacked grads as bf16).

total = params + optimizer + batch + grads + the larger of two phases of the backward pass
(`gathered_memory.gathered_by_phase`, docs/planning.md "Phases of the backward pass"):
* the layer backward: activations (saved layers, one layer's working set, the head) + the
  gathered layers + the unreduced grads in flight (XLA:CPU one weight's; XLA:GPU each weight
  gathered or as its gradient, not both) (the columns `gathered` and `activations`);
* one layer's gradient reduction (`reduction_phase`): the saved layers + that layer gathered +
  all its unreduced grads (no working set, no head).
The optimizer update (after the backward pass) runs in place on the donated state and needs
less than either.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from fsdp_jax.app.models.lora import is_adapter, spec_from_config
from fsdp_jax.app.objectives.preference_run import pair_rows
from fsdp_jax.app.planner import moe_memory, nvme_plan
from fsdp_jax.app.planner.abstract_step import StepBuild
from fsdp_jax.app.planner.context_memory import context_attention_bytes
from fsdp_jax.app.planner.gathered_memory import gathered_by_phase
from fsdp_jax.app.planner.residuals import everything_per_token, flash, saved_per_token
from fsdp_jax.attention import Q_CHUNK
from fsdp_jax.hlo.memory import shard_bytes, tree_bytes_per_device
from fsdp_jax.sharding import axes
from fsdp_jax.sharding.offload import get_offload, transfer_bytes
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.remat import device_policies


def activation_bytes(
    model_cfg,
    remat: str,
    batch_per_device: int,
    seq_len: int,
    compute_dtype="float32",
    expert_shards: int = 1,
    dense_ragged: bool = False,
    exchange_shards: int = 1,
    context: int = 1,
    phases: bool = False,
) -> dict[str, int]:
    """Activation bytes per device for the reference decoder: `layers` (what the layer
    loop keeps for backward), `working` (one layer's backward), `head` (logits and
    loss), and `total`. `batch_per_device`: sequences per device per microbatch;
    `context`: the `context` axis size (each sequence split over that many devices). A
    mixture of experts: its sparse layers' terms replace their dense MLP's
    (`planner/moe_memory.py`; `expert_shards`, `dense_ragged`, `exchange_shards` are its arguments).
    `phases`: with `context` > 1, one layer's backward is the larger of its MLP's and its ring's
    (`mlp_phase_per_token`: XLA:CPU's schedule); else their sum."""
    c = np.dtype(compute_dtype).itemsize
    t = batch_per_device * seq_len // context  # tokens per device: the sequence split over `context`
    d, h, v = model_cfg.d_model, model_cfg.n_heads, model_cfg.vocab_size
    ring = {"saved": 0, "working": 0}
    if context > 1:  # no S x S terms but those of the ring's blocks (`context_memory`)
        ring = context_attention_bytes(model_cfg, remat, batch_per_device, seq_len, c, context, Q_CHUNK)
        model_cfg = dataclasses.replace(model_cfg, attention="cudnn")
    layers = model_cfg.n_layers * (t * (c * d + saved_per_token(model_cfg, remat, seq_len, c)) + ring["saved"])
    none = everything_per_token(model_cfg, seq_len, c)
    working = none
    if moe_memory.n_sparse(model_cfg):
        sparse = moe_memory.moe_saved_per_token(model_cfg, remat, t, c, exchange_shards)
        sparse -= moe_memory.dense_mlp_per_token(model_cfg, remat, c)
        layers += int(moe_memory.n_sparse(model_cfg) * t * sparse)
        moe_none = moe_memory.moe_working_per_token(model_cfg, t, c, expert_shards, dense_ragged, exchange_shards)
        working = max(none, none - moe_memory.dense_mlp_everything(model_cfg, c) + moe_none)
    working = t * (working + (0 if flash(model_cfg) else (4 + c) * h * seq_len))
    if phases and context > 1:  # the ring's phase: the layer's activations but the MLP's, and the ring
        working = max(working, t * (none - mlp_phase_per_token(model_cfg, c)) + ring["working"])
    else:
        working += ring["working"]
    working = int(working)
    head = t * (c * d + v * (c + 4 + 4))
    return {"layers": layers, "working": working, "head": head, "total": layers + working + head}


def mlp_phase_per_token(model_cfg, compute_bytes: int) -> int:
    """Bytes a token of what one layer's MLP backward reads and its ring attention's backward does
    not: the second norm's output, the out projection's output, gate / up / SiLU / product,
    c x (2D + 4F). XLA:CPU runs a layer's MLP backward to its end before the ring's, so at the
    ring's peak none of them is live (docs/planning.md "Item 7's jax 0.12.0.1 ring cases": every
    ring peak of tests/test_context_memory.py, jax 0.10.2 and 0.12.0.1); XLA:GPU schedules the
    MLP's weight-gradient dots across the ring's backward, so its phases overlap (summed there)."""
    return compute_bytes * (2 * model_cfg.d_model + 4 * model_cfg.ffn_dim)


def analytic_memory(build: StepBuild, platform: str | None = None) -> dict[str, int]:
    """Per-device bytes by formula (no compile): params, optimizer (incl. the step
    counter and any non-trainable model state), batch, grads, gathered, activations, total and
    `reduction_phase`. `platform`: what the step is planned for ("cpu", "gpu", "tpu"; default the
    build's devices': the search builds on CPU devices for a target)."""
    cfg, plan, st = build.cfg, build.plan, build.state
    policy = Policy.parse(cfg.precision)
    params = tree_bytes_per_device(st.params)
    optimizer = (
        tree_bytes_per_device(st.opt_state) + tree_bytes_per_device(st.step) + tree_bytes_per_device(st.model_state)
    )  # non-trainable model state (0 when none; FP8's amax histories, docs/fp8.md)
    batch = tree_bytes_per_device(build.batch)  # tokens, or the packed batch's arrays
    gd = grad_dtype(policy)
    keep = _trainable(build)  # LoRA: grads, accumulator and reduced layer grads of the adapters only
    pairs = [pg for pg, k in zip(zip(jax.tree.leaves(st.params), jax.tree.leaves(plan.grads)), keep) if k]
    grads = sum(shard_bytes(jax.ShapeDtypeStruct(p.shape, _held(p.dtype, gd), sharding=g)) for p, g in pairs)
    if cfg.train.microbatches > 1:  # plus the accumulator, in the params' dtype (fsdp_jax.train.step)
        grads += sum(shard_bytes(jax.ShapeDtypeStruct(p.shape, p.dtype, sharding=g)) for p, g in pairs)
    platform = platform or build.mesh.devices.flat[0].platform
    gathered = gathered_by_phase(build, keep, policy, platform)
    act = activation_bytes(
        cfg.model,
        cfg.remat,
        _batch_per_device(build),
        cfg.data.seq_len,
        policy.compute_dtype,
        *_moe_args(build),
        context=_context(build),
        phases=platform == "cpu",
    )
    out = {
        "params": params,
        "grads": grads,
        "optimizer": optimizer,
        "gathered": gathered["backward"],
        "activations": act["total"],
        "batch": batch,
    }
    out["total"] = sum(out.values())
    # the peak is the larger of two phases (docs/planning.md, "Phases"): the layer backward's
    # (the columns above) and one layer's gradient reduction (the saved layers, that layer's
    # weights and its unreduced grads; no working set, no head)
    out["reduction_phase"] = act["layers"] + gathered["reduction"]
    out["total"] += max(0, out["reduction_phase"] - act["total"] - gathered["backward"])
    out["states"] = params + grads + optimizer  # the classic table's "total per device"
    if not all(keep):  # what the update reads and writes besides its state (the step-time model)
        out["trainable"] = sum(shard_bytes(p) for p, k in zip(jax.tree.leaves(st.params), keep) if k)
    nvme = nvme_plan.is_nvme(build.cfg.offload)  # built without offload: the nvme step wraps it
    out.update(nvme_plan.nvme_memory(build, out, DEVICES_PER_HOST) if nvme else offload_memory(build, out))
    return out


def _trainable(build: StepBuild) -> list[bool]:
    """One bool per param leaf: does the step train it (LoRA: the adapters only)."""

    paths = jax.tree_util.tree_flatten_with_path(build.state.params)[0]
    lora = spec_from_config(build.cfg.lora) is not None
    return [not lora or is_adapter(p) for p, _ in paths]


def grad_dtype(policy: Policy):
    """The dtype grads are reduced and held in until the update: the narrower of the
    compute and reduce dtypes. A weight gradient is a partial sum made by a dot in the
    compute dtype, and the partitioner reduces it at that dot (BENCHMARKS.md, issue 26:
    `reduce=float32` under bf16 compute still reduce-scatters in bf16)."""
    c, r = np.dtype(policy.compute_dtype), np.dtype(policy.reduce_dtype)
    return c if c.itemsize < r.itemsize else r


def _held(param_dtype, gd):
    """A floating param's grad is held in `gd`; other leaves keep their dtype."""
    return gd if np.issubdtype(np.dtype(param_dtype), np.floating) else param_dtype


DEVICES_PER_HOST = 8  # for bytes per host: GPUs per node (the planner's fake devices share one)


def offload_memory(build: StepBuild, analytic: dict[str, int], offload: str | None = None) -> dict[str, int]:
    """Host offload (`cfg.offload`) split of the analytic bytes: `host` (per device: its
    share of the offloaded params / optimizer state, resting in its host's pinned
    memory), `host_per_host` (x DEVICES_PER_HOST) and `device_total`: the total minus
    what rests on the host, plus what comes back transiently: the compute-dtype copy of
    offloaded params (sharded as at rest) for the forward/backward pass, and one
    leaf's params + optimizer state during the update (assumes XLA streams the update
    leaf by leaf; a schedule that fetches all at once needs the full state again), or,
    with a `:streamed` offload, two layers of every stacked leaf's params + state, and
    (params offloaded) two layers of the stacked leaves' compute copy: the model's layer
    loop fetches them one layer at a time (`fsdp_jax.train.layer_gather`).
    `offload`: the setting to split for (default: the build's own)."""

    off = get_offload(build.plan.offload if offload is None else offload)
    st = build.state
    params = tree_bytes_per_device(st.params)
    opt = tree_bytes_per_device(st.opt_state)
    host = (params if off.params else 0) + (opt if off.opt_state else 0)
    c = np.dtype(Policy.parse(build.cfg.precision).compute_dtype).itemsize
    compute_copy = (
        sum(
            shard_bytes(x) // x.dtype.itemsize * c
            for x in jax.tree.leaves(st.params)
            if np.issubdtype(x.dtype, np.floating)
        )
        if off.params
        else 0
    )
    largest = max((shard_bytes(x) for x in jax.tree.leaves(st.params)), default=0)
    layered = build.plan.layered
    if off.stream and layered is not None and any(jax.tree.leaves(layered)):
        # streamed (train.stream_update): two layers of the stacked leaves in flight at a time
        flags = jax.tree.leaves(layered)
        stacked = [x for x, m in zip(jax.tree.leaves(st.params), flags) if m]
        largest = 2 * sum(shard_bytes(x) for x in stacked) // stacked[0].shape[0]
        if off.layers:  # and the model's layer loop fetches them (train.layer_gather): two
            # layers' compute copy in flight instead of the whole stack's
            floats = [np.issubdtype(x.dtype, np.floating) for x in jax.tree.leaves(st.params)]
            stacked_copy = sum(
                shard_bytes(x) // x.dtype.itemsize * c
                for x, m, f in zip(jax.tree.leaves(st.params), flags, floats)
                if m and f
            )
            compute_copy -= stacked_copy - 2 * stacked_copy // stacked[0].shape[0]
    update = int(largest * ((1 if off.params else 0) + (opt / params if off.opt_state and params else 0)))

    moved = transfer_bytes(st, off, layered)
    return {
        "host": host,
        "host_per_host": host * DEVICES_PER_HOST,
        "device_total": analytic["total"] - host + compute_copy + update,
        "transfer_per_step": moved["to_device"] + moved["to_host"],
    }


def activations_by_remat(build: StepBuild) -> dict[str, int]:
    """Analytic activation bytes per device for every remat policy the search tries on the device."""
    cfg = build.cfg
    dtype = Policy.parse(cfg.precision).compute_dtype
    return {
        name: activation_bytes(
            cfg.model,
            name,
            _batch_per_device(build),
            cfg.data.seq_len,
            dtype,
            *_moe_args(build),
            context=_context(build),
            phases=build.mesh.devices.flat[0].platform == "cpu",
        )["total"]
        for name in device_policies()
    }


def _context(build: StepBuild) -> int:
    """The `context` axis size: each sequence split over that many devices."""
    return build.mesh.shape.get(axes.CONTEXT, 1)


def _moe_args(build: StepBuild) -> tuple[int, bool, int]:
    """(expert shards over non-batch axes, ragged_dot lowered densely, expert shards over batch
    axes) of the build: its rules and its devices' platform."""
    split, exchange = moe_memory.expert_shards(dict(build.mesh.shape), build.plan.rules)
    return split, build.mesh.devices.flat[0].platform == "cpu", exchange


def _batch_per_device(build: StepBuild) -> int:
    """Sequences per device per microbatch: the batch dim is sharded over data x fsdp; a
    preference batch's pairs are two rows each (chosen and rejected, one forward), a packed
    preference row one."""
    n = build.mesh.shape.get(axes.DATA, 1) * build.mesh.shape.get(axes.FSDP, 1)
    rows = pair_rows(build.cfg)
    return rows * build.cfg.train.global_batch // build.cfg.train.microbatches // n


def argument_bytes(analytic: dict[str, int]) -> int:
    """The step's argument bytes per device by the analytic model: params + optimizer state +
    batch shards, plus `tile_padding` where the plan has one (XLA:TPU pads each argument
    to its layout's tiles: `fsdp_jax.targets.tpu.tile_padding`)."""
    return analytic["params"] + analytic["optimizer"] + analytic["batch"] + analytic.get("tile_padding", 0)


def analytic_vs_compiled(analytic: dict[str, int], compiled: dict[str, int]) -> dict[str, float]:
    """How far the compiled program is from the analytic model, per term (compiled /
    analytic - 1): `argument` (`argument_bytes`), `temp` (grads + gathered +
    activations: everything transient) and `peak` (total)."""
    pairs = {
        "argument": (compiled["argument"], argument_bytes(analytic)),
        "temp": (compiled["temp"], analytic["grads"] + analytic["gathered"] + analytic["activations"]),
        "peak": (compiled["peak"], analytic["total"]),
    }
    return {k: (c / a - 1 if a else float("nan")) for k, (c, a) in pairs.items()}
