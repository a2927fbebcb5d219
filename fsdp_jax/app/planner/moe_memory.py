"""The mixture-of-experts terms of the analytic memory model (`planner/memory_model.py`):
what a sparse layer keeps for the backward pass and what one sparse layer's backward holds,
per token of the device (bytes), in place of the dense MLP's terms.

With c = bytes of the compute dtype, D = d_model, F = moe_ffn_dim, E = n_experts, k =
experts_per_token and r the expert rows per token (dropless: k, the top-k expanded
tokens; capacity mode: E * C / T, the (E, C, D) buffer's rows), one sparse layer
(`models/moe.py`, `models/moe_dispatch.py`) makes per token:
* the router: its logits in the compute dtype (c*E, a dot) and in f32 with the softmax
  probabilities (8E), the top-k weights, experts and the sort order (12k, 4-byte);
* the dispatch: the sorted token copy / capacity buffer (c*r*D) and the group sizes ((E,)
  int32, per layer, not per token: ignored);
* the experts: gate and up projections, SiLU and product (c*r*4F, the expert FFN
  intermediate) and the down projection (c*r*D);
* the combine: outputs back in (token, slot) order (c*k*D) and their weighted sum (c*D).
What the remat policy's record keeps of these (`moe_saved_per_token`, `moe_residuals`): `none`
all; `dots` the dots: router logits and combine (and in capacity mode the experts' batched matmuls, c*r*(2F + D));
`ragged_dot` is not a dot to `jax.checkpoint_dots`, so dropless experts are recomputed;
`dots_no_batch` the router logits (the combine and capacity matmuls have batch dims); the
name policies keep `mlp_out` (the layer output, c*D, already in the dense formula) and no
MoE term; `full` nothing. Qwen2-MoE's shared expert adds a dense gated MLP of
shared_expert_ffn_dim (Fs): none 4c*Fs, dots / dots_no_batch 2c*Fs.

One sparse layer's backward working set (`moe_working_per_token`) is the `none` terms
again. XLA:CPU lowers `ragged_dot` densely (every row against every local expert, masked),
and its compiled step holds, at the sparse layer's backward peak (read from the buffer
assignment of the f32 tiny step on 8 CPU devices, dropless, experts over fsdp and over data),
six F-sized masked buffers ((E_l, rows, F) and (rows, E_l x F), three of each), two D-sized
masked operands ((E_l, rows, D): the layer input and the down projection's output gradient)
and two plain (rows, D) buffers (three with experts over batch shards: the received block),
and none of the unmasked expert intermediate beside the weight gradient's dot (the masked
buffers hold it): so on CPU the expert terms of a dropless layer are
c * r * (6 E_l F + 2 E_l D + 2D), + c * r * D with the exchange (`ragged_dense_per_token`,
`dense_ragged`), in place of c * r * (2D + 4F) and the exchange's blocks. (A second shape, E 4,
k 3, F 96, holds the same buffers, and at the instant before that dot also the three unmasked
(rows, F) gate / up / SiLU outputs: 0.22 of its 3.58 MB live, not counted; with one local expert
they are not live.) GPU and TPU lower `ragged_dot` to the grouped-matmul instruction.

Experts over n batch shards (`mesh.rules: {expert: data}`, the all-to-all exchange): dropless
blocks of N * k rows come from each of the n shards, so r = n * k (most rows empty) with
E_l = E / n, and the blocks sent and returned add c * r * 2D; capacity mode receives the
same E * C rows it would compute without the exchange.
"""

from __future__ import annotations

import math

from fsdp_jax.app.models.moe import capacity
from fsdp_jax.app.models.stack import sparse_layers
from fsdp_jax.app.planner.residuals import GATE_UP, rematerialised
from fsdp_jax.sharding.remat import Residual


def expert_rows_per_token(model_cfg, tokens: int, exchange: int = 1) -> float:
    """r: rows of expert compute per token of the device (k dropless, E * C / T with capacity).
    `exchange` > 1: experts over that many batch shards (`models/moe_exchange.py`), whose
    dropless blocks hold N * k rows from every shard: k * exchange."""
    k, e = model_cfg.experts_per_token, model_cfg.n_experts
    if not model_cfg.capacity_factor or tokens <= 0:
        return float(k * exchange)
    return e * capacity(tokens, k, e, model_cfg.capacity_factor) / tokens


def moe_saved_per_token(model_cfg, remat: str, tokens: int, c: int, exchange: int = 1) -> float:
    """Bytes a sparse layer keeps per token for the backward under `remat`, in place of the
    dense MLP's (module docstring): all terms, or what its record keeps of `moe_residuals`;
    `tokens`: per device per microbatch."""
    policy = rematerialised(remat)
    if policy.keeps_everything:
        return _all_terms(model_cfg, tokens, c, exchange)
    return sum(b for r, b in moe_residuals(model_cfg, tokens, c) if policy.keeps(r))


def moe_residuals(model_cfg, tokens: int, c: int) -> tuple[tuple[Residual, float], ...]:
    """The residuals a policy may keep of one sparse layer and their bytes per token: the
    router logits (a dot without batch dims), the combine and, in capacity mode, the experts'
    batched matmuls (dots with batch dims; dropless `ragged_dot` is no dot), the shared
    expert's gate and up."""
    d, f, e = model_cfg.d_model, model_cfg.moe_ffn_dim, model_cfg.n_experts
    r, fs = expert_rows_per_token(model_cfg, tokens), model_cfg.shared_expert_ffn_dim
    batched = Residual("", dot=True, batch_dims=True)
    experts = ((batched, c * r * (2 * f + d)),) if model_cfg.capacity_factor else ()
    return (
        (Residual("", dot=True), c * e),  # router logits
        (batched, c * d),  # combine
        (Residual("", dot=True), c * 2 * fs),  # shared expert gate and up
        *experts,  # last: the one float, added as the formula adds it
    )


def _all_terms(model_cfg, tokens: int, c: int, exchange: int = 1) -> float:
    r = expert_rows_per_token(model_cfg, tokens, exchange)
    d, f = model_cfg.d_model, model_cfg.moe_ffn_dim
    experts = c * r * (2 * d + 4 * f) + (c * r * 2 * d if exchange > 1 else 0)  # + the blocks sent and returned
    return _router_and_combine(model_cfg, c) + experts


def _router_and_combine(model_cfg, c: int) -> float:
    """The router (logits, f32 probabilities, top-k ids / weights / order), the combine's
    (token, slot) outputs and their sum, and the shared expert (module docstring)."""
    d, e, k, fs = model_cfg.d_model, model_cfg.n_experts, model_cfg.experts_per_token, model_cfg.shared_expert_ffn_dim
    return c * e + 8 * e + 12 * k + c * (k * d + d) + 4 * c * fs


def moe_working_per_token(
    model_cfg, tokens: int, c: int, expert_shards: int, dense_ragged: bool, exchange: int = 1
) -> float:
    """One sparse layer's backward working set per token (module docstring); `expert_shards`:
    the size of the non-batch mesh axes the experts are split over (tensor), `exchange` of the
    batch axes (data: all-to-all); `dense_ragged`: the backend lowers `ragged_dot` densely (XLA:CPU),
    whose masked buffers replace the dropless experts' terms."""
    if dense_ragged and not model_cfg.capacity_factor:
        return _router_and_combine(model_cfg, c) + ragged_dense_per_token(
            model_cfg, c, expert_shards * exchange, exchange
        )
    return _all_terms(model_cfg, tokens, c, exchange)


def ragged_dense_per_token(model_cfg, c: int, expert_shards: int, exchange: int = 1) -> float:
    """XLA:CPU's dropless expert buffers per token (module docstring): E_l experts
    (`expert_shards`: every axis they are split over) x the rows per token, six F-sized and two
    D-sized masked, two D-sized plain (three with the exchange): c * r * (6 E_l F + 2 E_l D + 2D)."""
    e_local = model_cfg.n_experts // max(expert_shards, 1)
    d, f = model_cfg.d_model, model_cfg.moe_ffn_dim
    plain = 3 if exchange > 1 else 2
    return c * expert_rows_per_token(model_cfg, 0, exchange) * (6 * e_local * f + 2 * e_local * d + plain * d)


def n_sparse(model_cfg) -> int:
    """How many layers are sparse (transformers' rule, `models/stack.py`)."""

    return sum(sparse_layers(model_cfg)) if model_cfg.n_experts else 0


def dense_mlp_per_token(model_cfg, remat: str, c: int) -> int:
    """The dense MLP's share of `saved_per_token` (`planner/residuals.py`) for `remat`: what a
    sparse layer does not keep (its MLP is the experts): all of it (`dense_mlp_everything`)
    or its gate and up when the record keeps them (`mlp_out` stays: the layer output)."""
    policy = rematerialised(remat)
    if policy.keeps_everything:
        return dense_mlp_everything(model_cfg, c)
    return 2 * c * model_cfg.ffn_dim if policy.keeps(GATE_UP) else 0


def dense_mlp_everything(model_cfg, c: int) -> int:
    """The dense MLP's share of a layer without remat: gate, up, SiLU and product."""
    return 4 * c * model_cfg.ffn_dim


def expert_shards(mesh_shape: dict, rules: dict | None) -> tuple[int, int]:
    """(size of the non-batch mesh axes the rules map `expert` to, size of the batch ones:
    `data`, the all-to-all exchange); (1, 1): experts not split."""
    entry = (rules or {}).get("expert")
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    batch = ("data", "fsdp")
    split = math.prod(mesh_shape.get(a, 1) for a in axes if a not in batch)
    return split, math.prod(mesh_shape.get(a, 1) for a in axes if a in batch)
