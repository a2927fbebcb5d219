"""Where and how the (token, expert) pairs of a sparse layer are computed.

`dropless` sorts the pairs by expert and runs them through grouped matmuls
(`models/grouped_matmul.py`: `jax.lax.ragged_dot`, or tokamax's kernels on GPU);
`with_capacity` gathers at most C tokens per expert into an (E, C, D) buffer and runs
batched matmuls over it. Both take the experts `e0 .. e0 + E_local - 1` (their weights'
leading dim) and compute only the pairs routed to those; the others contribute 0.

`per_batch_shard` runs one of them under the current mesh, from the logical rules alone:
- tokens are routed on the device that holds them: a `shard_map` over the mesh axes
  `batch` maps to, the token arrays split on their leading N dim;
- expert parallelism: when the rules map `expert` to mesh axes (e.g. `mesh.rules:
  {expert: tensor}`), each device of those axes holds E / n of the experts (in compute
  too: the rule is not an fsdp one, so the per-layer gather keeps that split), computes its
  experts' pairs for the tokens its group shares, and the partial outputs are summed over
  those axes (an all-reduce). Expert axes that do not shard `batch` (tensor) replicate the
  tokens over them: no all-to-all;
- expert parallelism over batch axes (`mesh.rules: {expert: data}`): each device holds its
  tokens and E / n of the experts, and the pairs travel by all-to-all
  (`models/moe_exchange.py`). n_experts must divide by the expert axes' size.
Without a mesh (or with nothing sharded) the function runs as it is.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import linen as nn
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from fsdp_jax.app.models.grouped_matmul import grouped_matmul, resolve
from fsdp_jax.quant import fp8_experts, fp8_rowwise_experts
from fsdp_jax.sharding.axes import BATCH, EXPERT


def gated(h_gate, h_up):
    return jax.nn.silu(h_gate) * h_up


@dataclasses.dataclass(frozen=True)
class ExpertLora:
    """The experts' LoRA adapters (`fsdp_jax.app.models.lora.ExpertAdapter`): which of
    `experts_gate_up` / `experts_down` are present (their (A, B) pairs follow the three expert weights in
    a weights tuple, in this order) and the scale."""

    parts: tuple[str, ...]
    scale: float


def group_rows(sizes, n_rows: int):
    """For rows grouped by expert (`sizes` (E_l,) rows each, the rest in no group): a function
    taking per-expert vectors (E_l, X) to per-row ones (n_rows, X), 0 past the groups."""

    def rows(b):  # traced only where an ffn uses it
        gid = jnp.searchsorted(jnp.cumsum(sizes), jnp.arange(n_rows), side="right")  # (n_rows,) in 0..E_l
        return jnp.concatenate([b, jnp.zeros((1, b.shape[-1]), b.dtype)])[gid]

    return rows


@dataclasses.dataclass(frozen=True)
class GroupedDot:
    """One grouped expert product `dot(x, m)` over rows grouped by `sizes` (E_l,) (`grouped_matmul`
    `impl`); `fp8_dot` reads its sizes."""

    sizes: jax.Array
    impl: str = "auto"

    def __call__(self, x, m):
        return grouped_matmul(x, m, self.sizes, self.impl)


def fp8_dot(dot, rowwise: bool = False):
    """`dot` (a `GroupedDot` or `batched`) as scaled FP8 matmuls with a scale per expert
    (`fsdp_jax.quant.fp8_experts`; `rowwise`: per row and per expert column,
    `fsdp_jax.quant.fp8_rowwise_experts`): batched products always; grouped ones where `impl`
    resolves to XLA's `ragged_dot` (which then takes the f8 operands). Where it resolves to
    tokamax's kernels (GPU with tokamax installed, `auto`) the grouped products stay those
    kernels in the compute dtype: XLA:GPU expands an f8 `ragged_dot` densely, n_experts times
    the FLOPs. A weight may come as an `fp8_experts.ExpertWeight` (its delayed histories, its
    f8 gather from the at-rest shard: only where the FP8 product runs, `moe.MoE`)."""
    if not isinstance(dot, GroupedDot):
        if rowwise:

            def rowwise_batched(x, m):
                m = fp8_experts.unpack(m)
                return fp8_rowwise_experts.batched_matmul(x, m.w, m.gather)

            return rowwise_batched
        return lambda x, m: fp8_experts.batched_matmul(x, *fp8_experts.unpack(m))

    def grouped(x, m):
        m, hist, gather = fp8_experts.unpack(m)
        if resolve(dot.impl, (x.shape[0], x.shape[1], m.shape[2])) != "xla":
            return dot(x, m)
        if rowwise:
            return fp8_rowwise_experts.grouped_matmul(x, m, dot.sizes, gather)
        return fp8_experts.grouped_matmul(x, m, dot.sizes, hist, gather)

    return grouped


def batched_rows(b):
    """Per-expert vectors (E, X) for the batched layout (E, C, X)."""
    return b[:, None, :]


def experts_ffn(x, ws, lora: ExpertLora | None, dot, rows=None):
    """The experts' gated MLP with their adapters on rows `x`: `dot(x, w)` one expert product
    (grouped `ragged_dot` or batched einsum), `ws` (w_gate, w_up, w_down, *adapters). Each
    adapter is two thin products (x A) B: no product of a frozen weight's shape. `rows`
    (`group_rows` / `batched_rows`: per-expert vectors to the rows' layout) is for experts with
    biases (`fsdp_jax.app.models.moe.MoE.expert_ffn`); these have none."""
    wg, wu, wd = ws[:3]
    pairs = dict(zip(lora.parts, zip(ws[3::2], ws[4::2]))) if lora else {}

    def lora_term(x, name):
        a, b = pairs[name]
        t = dot(dot(x, a), b)
        return t * jnp.asarray(lora.scale, t.dtype)

    hg, hu = dot(x, wg), dot(x, wu)
    if "experts_gate_up" in pairs:  # one adapter for both halves, gate first (transformers' gate_up_proj)
        t, f = lora_term(x, "experts_gate_up"), wg.shape[-1]
        hg, hu = hg + t[..., :f], hu + t[..., f:]
    h = gated(hg, hu)
    y = dot(h, wd)
    return y + lora_term(h, "experts_down") if "experts_down" in pairs else y


def dropless(x2, w, idx, ws, e0=0, lora: ExpertLora | None = None, impl: str = "auto", ffn=experts_ffn):
    """The pairs routed to experts e0.., sorted by expert, through grouped matmuls
    (`grouped_matmul` `impl`). x2 (N, D); w, idx (N, k); ws: wg, wu (E_local, D, F), wd
    (E_local, F, D) and the adapters (or what `ffn`, `experts_ffn`'s signature, takes) -> ((N, D), 0)."""
    n, k = idx.shape
    el = ws[0].shape[0]
    loc = idx - e0
    mine = (loc >= 0) & (loc < el)
    flat = jnp.where(mine, loc, el).reshape(-1)  # (N*k,); others sort last, in no group
    order = jnp.argsort(flat, stable=True)
    sizes = jnp.bincount(flat, length=el + 1)[:el].astype(jnp.int32)  # (E_local,)
    xs = x2[order // k]  # (N*k, D), grouped by expert
    ys = ffn(xs, ws, lora, GroupedDot(sizes, impl), group_rows(sizes, n * k))  # (N*k, D)
    y = jnp.zeros_like(ys).at[order].set(ys).reshape(n, k, -1)  # back to (token, slot)
    return jnp.einsum("nkd,nk->nd", y, (w * mine).astype(y.dtype)), jnp.zeros((), jnp.float32)


def capacity_slots(idx, cap: int, n_experts: int, e0: int = 0, el: int | None = None):
    """Capacity mode's bookkeeping for experts e0 .. e0 + el - 1 (default all): the first `cap`
    pairs of each expert in token order win. idx (N, k) -> (mine, keep (N, k) bool, slot (N, k):
    row loc * cap + pos of the (el * cap) buffer, el * cap for the others, tok (el * cap + 1,):
    the token of each row, N for an empty one)."""
    n, k = idx.shape
    el = n_experts if el is None else el
    onehot = jax.nn.one_hot(idx, n_experts, dtype=jnp.int32)  # (N, k, E)
    # position of each pair in its expert's queue: pairs ordered token-major, slot-minor
    pos = jnp.cumsum(onehot.reshape(n * k, n_experts), axis=0).reshape(n, k, n_experts) - onehot
    pos = jnp.sum(pos * onehot, axis=-1)  # (N, k)
    loc = idx - e0
    mine = (loc >= 0) & (loc < el)
    keep = (pos < cap) & mine
    slot = jnp.where(keep, loc * cap + pos, el * cap)  # dropped / other pairs -> a spare row
    tok = jnp.full((el * cap + 1,), n, jnp.int32).at[slot.reshape(-1)].set(jnp.repeat(jnp.arange(n), k))
    return mine, keep, slot, tok


def batched(x, m):
    """One product per expert: x (E, C, in) with m (E, in, out)."""
    return jnp.einsum("eci,eio->eco", x, m)


def with_capacity(x2, w, idx, ws, cap: int, n_experts: int, e0=0, lora: ExpertLora | None = None, ffn=experts_ffn):
    """At most `cap` tokens per expert (token order wins), the rest dropped; only experts
    e0 .. e0 + E_local - 1 computed. -> (out (N, D), dropped pairs of those experts (f32))."""
    el = ws[0].shape[0]
    mine, keep, slot, tok = capacity_slots(idx, cap, n_experts, e0, el)
    xpad = jnp.concatenate([x2, jnp.zeros((1, x2.shape[1]), x2.dtype)])
    buf = xpad[tok[:-1]].reshape(el, cap, -1)  # (E_local, C, D); empty rows are zeros
    buf = checkpoint_name(buf, "moe_dispatch")
    yb = ffn(buf, ws, lora, batched, batched_rows).reshape(el * cap, -1)
    ypad = jnp.concatenate([yb, jnp.zeros((1, yb.shape[1]), yb.dtype)])
    y = ypad[slot]  # (N, k, D); dropped pairs read the zero row
    out = jnp.einsum("nkd,nk->nd", y, (w * keep).astype(y.dtype))
    return out, jnp.sum(mine & ~keep).astype(jnp.float32)


def _mesh_axes(mesh, name: str) -> tuple[str, ...]:
    """The mesh axes (of size > 1) the current logical rules map dim `name` to."""
    entry = nn.logical_to_mesh_axes((name,))[0]
    axes = () if entry is None else ((entry,) if isinstance(entry, str) else tuple(entry))
    return tuple(a for a in axes if mesh.shape.get(a, 1) > 1)


def per_token_shard(fn, *arrays):
    """`fn(*arrays)`, a per-token (row-wise) function of arrays with a leading N dim, run on
    each batch shard of the current mesh (the router's top-k: left to the partitioner, XLA's
    TopK gathered the (N, E) logits of the whole batch to every device)."""
    mesh = jax.sharding.get_abstract_mesh()
    batch = () if mesh.empty else _mesh_axes(mesh, BATCH)
    if not batch:
        return fn(*arrays)
    return jax.shard_map(fn, mesh=mesh, in_specs=tuple(P(batch) for _ in arrays), out_specs=P(batch))(*arrays)


def per_batch_shard(fn, tokens, weights, exchange=None, weight_specs=()):
    """`fn(*tokens, *weights, e0) -> (y, dropped)` per batch shard (and expert shard) of the
    current mesh; y summed over the expert axes, `dropped` over every axis. `tokens` have a
    leading N dim; `weights` a leading expert dim. When the expert axes are batch axes,
    `exchange(*tokens, *weights, expert_axes, n_ep) -> (y, dropped)` (`models/moe_exchange.py`:
    tokens moved to their experts by all-to-all) runs per batch shard instead. `weight_specs`:
    the specs of the first weights where they enter as their at-rest shards (FP8 expert
    gathers, `fsdp_jax.quant.fp8_expert_gather`), the others split over the expert axes only.
    ValueError (one line) for an expert split the decoder does not compute."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty:
        return fn(*tokens, *weights, 0)
    batch, expert = _mesh_axes(mesh, BATCH), _mesh_axes(mesh, EXPERT)
    if not batch and not expert:
        return fn(*tokens, *weights, 0)
    n_experts = weights[0].shape[0]
    n_ep = math.prod(mesh.shape[a] for a in expert)
    if n_experts % n_ep:
        raise ValueError(
            f"model.n_experts={n_experts} is not divisible by the expert mesh axes {', '.join(expert)} (size {n_ep})"
        )
    if set(expert) & set(batch):
        if not set(expert) <= set(batch) or exchange is None:
            raise ValueError(
                f"rules: expert -> {', '.join(expert)}: the expert axes must be all batch axes "
                f"(batch -> {', '.join(batch)}; tokens moved by all-to-all) or none of them (tensor)"
            )

        def moved(*args):  # this device's tokens, its experts; the pairs travel by all-to-all
            y, dropped = exchange(*args, expert, n_ep)
            return y, jax.lax.psum(dropped, batch)

        ins = tuple(P(batch) for _ in tokens) + _weight_specs(weights, weight_specs, P(expert))
        return jax.shard_map(moved, mesh=mesh, in_specs=ins, out_specs=(P(batch), P()))(*tokens, *weights)

    def local(*args):
        e0 = jax.lax.axis_index(expert) * (n_experts // n_ep) if expert else 0
        if expert:  # the shared tokens meet expert-sharded values: say they vary over the expert
            # axes, so their cotangents (each shard's part) are summed over them
            args = (*jax.lax.pcast(args[: len(tokens)], expert, to="varying"), *args[len(tokens) :])
        y, dropped = fn(*args, e0)
        return y[None], jax.lax.psum(dropped, batch + expert)

    # each expert shard's partial output on a leading dim, summed outside the shard_map (the
    # partitioner's all-reduce over the expert axes; its transpose hands every shard the
    # whole cotangent)
    ins = tuple(P(batch or None) for _ in tokens) + _weight_specs(weights, weight_specs, P(expert or None))
    outs = (P(expert or None, batch or None), P())
    y, dropped = jax.shard_map(local, mesh=mesh, in_specs=ins, out_specs=outs)(*tokens, *weights)
    return jnp.sum(y, axis=0), dropped


def _weight_specs(weights, given, default) -> tuple:
    return tuple(given[i] if i < len(given) else default for i in range(len(weights)))
