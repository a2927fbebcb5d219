"""The gathered params of the analytic memory model (`planner/memory_model.py`): one concept,
the transient param-sized copies a step holds per device, and in which phase of the backward
pass they are live.

Gathered params (transient full-size copies in the compute dtype): full_shard / hybrid_shard
keep two layers in flight (the one computing, the next one prefetched) plus the largest
unstacked param (embedding or head); shard_grad_op keeps the whole model and the layer its
backward loop slices out of the kept stack; shard_opt / no_shard a compute-dtype copy only
when the compute dtype differs from the param dtype.

Phases. On XLA:CPU a layer's weight gradients are not live with its backward working set all
at once: each is made by its dot and reduced there, synchronously, so the layer backward's phase
(`backward`: saved layers, working set, head, the gathered layers) holds one weight's unreduced
gradient (the layer's largest stacked leaf, in the reduce dtype). On XLA:GPU the reduce-scatters
are asynchronous and combined (one per layer, at the end of the backward loop's body), but a
weight's gathered copy is freed at its input-gradient dot and its gradient is made by a later dot
(whose only user is that reduce-scatter): each weight is held gathered or as its unreduced
gradient, never both, so the layer differentiated is the larger of the two, whole, not their sum,
and the unstacked leaves' unreduced grads (the embedding's scatter-add accumulator, the head's
gradient) are held through the layer loop, reduce-scattered after it, in both phases
(read 2026-12-07 from the H100 compiles of the tiny capacity-mode MoE step and of the ring of
tests/test_flash_plan.py; docs/planning.md). On TPU targets, whose buffers were not read, the phase
keeps the layer gathered and all its unreduced grads. A second phase (`reduction`: the saved
layers, the layer gathered and all its unreduced grads; no working set, no head) covers a schedule
that keeps a layer's gradients together while no working set is live (the H100 target's
capacity-mode MoE step peaks at one layer's gate / up expert gradients, held twice: unreduced and
transposed for the reduce-scatter). The analytic total is the larger of the two (docs/planning.md,
"Phases of the backward pass"); before 2026-12-07 every plan added the layer's whole unreduced
grads to the layer backward's phase.
"""

from __future__ import annotations

import jax
import numpy as np

from fsdp_jax.app.config.fp8_checks import unscaled_experts
from fsdp_jax.app.planner.abstract_step import StepBuild
from fsdp_jax.quant.fp8 import E4M3
from fsdp_jax.sharding import axes, rules
from fsdp_jax.sharding.precision import Policy


def compute_copy_bytes(abstract_params, plan, logical_axes, dtype) -> dict[str, int]:
    """Per-device bytes of params in the compute layout (data/fsdp gathered, tensor
    sharding kept) in `dtype`: `whole` model, one `layer` of the stacked (scanned)
    params and its `largest_in_layer` leaf, the `largest_unstacked` leaf and all `unstacked`
    leaves together. A quantised
    base (`lora.base_quant`): its integer leaves count at their own bytes (they are what is
    gathered), and `dequantised_layer` is one layer's quantised weights dequantised in `dtype`
    (what the layer builds from its gathered codes before its matmuls)."""
    rows = rules.explain(abstract_params, plan.mesh, logical_axes, plan.rules, (), 0, allow_unshardable=True)
    names = (
        jax.tree.leaves(logical_axes, is_leaf=lambda x: x is None or isinstance(x, tuple))
        if logical_axes is not None
        else []
    )
    # `_only`'s trees: a dropped leaf is None in both; the rows cover the params that are there
    present = [x is not None for x in jax.tree.leaves(abstract_params, is_leaf=lambda x: x is None)]
    if len(names) == len(present) != len(rows):
        names = [n for n, p in zip(names, present) if p]
    names = names if len(names) == len(rows) else [None] * len(rows)
    item = np.dtype(dtype).itemsize
    out = {
        "whole": 0,
        "layer": 0,
        "largest_unstacked": 0,
        "unstacked": 0,
        "dequantised_layer": 0,
        "largest_in_layer": 0,
    }
    for row, nm in zip(rows, names):
        own = np.dtype(row.dtype)
        # a quantised weight's integer leaves are gathered as they are (codes, scales' bits)
        b = row.bytes_per_device if own.kind in "iu" else row.bytes_per_device // own.itemsize * item
        out["whole"] += b
        if nm and nm[0] == axes.LAYERS and row.shape:
            out["layer"] += b // row.shape[0]
            out["largest_in_layer"] = max(out["largest_in_layer"], b // row.shape[0])
            if row.path.split("/")[-1] == "codes":  # its weight, dequantised in `dtype` in the layer
                values = VALUES_PER_CODE_BYTE.get(own.name, 1) * row.bytes_per_device // own.itemsize
                out["dequantised_layer"] += values * item // row.shape[0]
        else:
            out["largest_unstacked"] = max(out["largest_unstacked"], b)
            out["unstacked"] += b
    return out


VALUES_PER_CODE_BYTE = {"uint8": 2, "int8": 1}  # NF4 packs two 4-bit codes a byte; int8 one (fsdp_jax.quant.weight)


def gathered_by_phase(build: StepBuild, keep: list[bool], policy: Policy, platform: str) -> dict[str, int]:
    """Transient param-sized bytes per device in the two phases of the backward pass that can
    make the peak: `backward` (a layer's backward working set: the prefetched layer, and the layer
    differentiated with its unreduced grads in flight, `_layer_and_grads`) and `reduction` (a
    layer's weight gradients, all unreduced at once: the layer gathered and its grads). Read
    from the compiled buffers (docs/planning.md, "Phases"); `keep`: the trained leaves (LoRA);
    `platform`: the one the step is planned for (its collectives: synchronous on "cpu")."""
    plan, st, s = build.plan, build.state, build.plan.strategy
    cc = compute_copy_bytes(st.params, plan, build.model.logical_axes, policy.compute_dtype)
    # one layer's unreduced grads come from the reference model's weight dots in the reduce
    # dtype (fsdp_jax.sharding.precision.matmul); the reduced shards are held in `gd`
    reduced = compute_copy_bytes(
        _only(st.params, keep), plan, _only(build.model.logical_axes, keep), policy.reduce_dtype
    )
    layer_r = reduced["layer"]
    # in flight during a layer's working set: on XLA:CPU (collectives synchronous) one weight's
    # unreduced gradient, reduced at its dot; on GPU / TPU the reduce-scatters are asynchronous
    # and combined, their done scheduled after later compute: the layer's (full_shard on GPU: in
    # place of the weights' gathered copies, `_layer_and_grads`; shard_grad_op keeps its copies)
    one_r = reduced["largest_in_layer"] if platform == "cpu" else layer_r
    if s.params and not s.gather_once:  # full_shard, hybrid_shard: per layer
        if (
            policy.matmul == "fp8" and build.cfg.fp8.gather is not False
        ):  # the layer's weights gathered in f8 (docs/fp8.md)
            cc["layer"] = _f8_layer(build, policy, platform)
        # XLA:GPU holds the unstacked leaves' unreduced grads (the embedding's scatter-add
        # accumulator, the head's gradient) through the layer loop's backward, reduce-scattered after it
        held = reduced["unstacked"] if platform == "gpu" else 0
        layers = {"backward": cc["layer"] + _layer_and_grads(cc["layer"], layer_r, one_r, platform) + held}
        layers["reduction"] = cc["layer"] + layer_r + held
        if all(keep):
            return {k: v + cc["dequantised_layer"] + cc["largest_unstacked"] for k, v in layers.items()}
        # LoRA: a frozen embedding / head is gathered only outside the layer loop (lookup; head
        # forward and input gradient), never for a weight gradient: XLA gives its buffer to the
        # layers' gathers (docs/qlora.md, "The search and the head")
        return {k: max(v + cc["dequantised_layer"], cc["largest_unstacked"]) for k, v in layers.items()}
    if s.params:  # shard_grad_op: the whole model gathered (kept for the backward), the
        # layer the backward loop slices out of that stack (XLA copies it: a dynamic-slice per
        # layer), and one layer's unreduced grads (each layer's are reduce-scattered in the
        # backward loop)
        kept = cc["whole"] + cc["layer"] + cc["dequantised_layer"]
        return {"backward": kept + one_r, "reduction": kept + layer_r}
    # shard_opt, no_shard: params already whole; a cast copy of those stored in another dtype
    cast = [  # a quantised base's integer leaves are not cast: they are dequantised layer by layer
        np.issubdtype(x.dtype, np.floating) and np.dtype(x.dtype) != np.dtype(policy.compute_dtype)
        for x in jax.tree.leaves(st.params)
    ]
    copy = (
        compute_copy_bytes(_only(st.params, cast), plan, _only(build.model.logical_axes, cast), policy.compute_dtype)[
            "whole"
        ]
        if any(cast)
        else 0
    )
    return {"backward": copy + cc["dequantised_layer"], "reduction": 0}


def _f8_layer(build: StepBuild, policy: Policy, platform: str) -> int:
    """One layer gathered under `fp8.gather`: its weights in f8, but for routed experts whose
    grouped products tokamax's kernels run in the compute dtype on `platform` (their weights are
    gathered so: `fp8_checks.unscaled_experts`, docs/fp8.md)."""
    st, plan, names = build.state, build.plan, build.model.logical_axes
    if unscaled_experts(build.cfg, platform) is None:
        return compute_copy_bytes(st.params, plan, names, E4M3)["layer"]
    leaves = jax.tree.leaves(names, is_leaf=lambda x: x is None or isinstance(x, tuple))
    expert = [n is not None and axes.EXPERT in n for n in leaves]
    other = [not e for e in expert]
    f8 = compute_copy_bytes(_only(st.params, other), plan, _only(names, other), E4M3)["layer"]
    return f8 + compute_copy_bytes(_only(st.params, expert), plan, _only(names, expert), policy.compute_dtype)["layer"]


def _layer_and_grads(layer: int, layer_r: int, one_r: int, platform: str) -> int:
    """The layer being differentiated, gathered, with its unreduced grads in flight (per layer:
    full_shard / hybrid_shard; the prefetched next layer is the caller's). XLA:CPU: the layer and
    one weight's gradient (reduced at its dot). XLA:GPU: a weight's gathered copy is freed at its
    input-gradient dot and its gradient is made by a later dot whose only user is the layer's
    combined reduce-scatter at the loop body's end, so each weight is held as one or the other,
    never both: the larger of the two, whole (docs/planning.md, "Phases"; the caller adds the
    unstacked leaves' unreduced grads, held through the loop there). Elsewhere (TPU, not
    read from its buffers): the layer and all its unreduced grads."""
    if platform == "cpu":
        return layer + one_r
    if platform == "gpu":
        return max(layer, layer_r)
    return layer + layer_r


def _only(tree, keep: list[bool]):
    """`tree`'s leaves where `keep` (None elsewhere: no bytes); `tree` None stays None."""
    if tree is None:
        return None
    is_leaf = lambda x: x is None or isinstance(x, tuple)  # noqa: E731  (logical-name tuples are leaves)
    leaves, treedef = jax.tree.flatten(tree, is_leaf=is_leaf)
    return treedef.unflatten([x if k else None for x, k in zip(leaves, keep)])
