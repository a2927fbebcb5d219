"""How `with_lora`'s wrapped apply runs the model: its jaxpr, eqn by eqn, with each
targeted weight kept factored (`Tracked`: W, A, B and the view taken of W) up to the
matrix products that use it, which compute x W + scale * (x A) B. Inner `jit`s are inlined
where a weight flows in, `remat` is re-applied with its policy and a `scan` slices a stacked
weight with its adapters; a weight going anywhere else (a custom derivative included) is merged (W + scale * A B), and while probing that use is
recorded, so `with_lora` leaves such a weight without an adapter."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
_REMAT = {"remat2", "checkpoint"}
_HINTS = {"sharding_constraint", "copy", "copy_p"}


@dataclasses.dataclass(frozen=True)
class AdaptedWeight:
    """A weight with an adapter: its path, shape, the dims its products contract and the
    shapes of A (stack dims..., contracted dims..., r) and B (stack dims..., r, free dims...).
    `depth`: W's leading dims that scans slice off before the products (a scanned stack of
    layers, each with its own adapter). `batch`: W's dims a batched product pairs with the
    input's (`einsum("bhd,hdk->bhk")`'s h): one adapter per index there too, A (stack dims...,
    batch dims..., contracted dims..., r), B (stack dims..., batch dims..., r, free dims...)."""

    path: str
    shape: tuple[int, ...]
    contracted: tuple[int, ...]
    free: tuple[int, ...]
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]
    depth: int = 0
    batch: tuple[int, ...] = ()


def delta_weight(t: AdaptedWeight, a, b, sliced: int = 0) -> jax.Array:
    """scale-free A B laid out as W (f32); `sliced`: stack dims already sliced off A and B."""
    ab = lambda a, b: jnp.tensordot(a, b, axes=1)  # noqa: E731  contracted dims..., free dims...
    for _ in range(t.depth - sliced + len(t.batch)):
        ab = jax.vmap(ab)
    out = ab(a.astype(jnp.float32), b.astype(jnp.float32))
    order = list(range(t.depth - sliced)) + [d - sliced for d in t.batch + t.contracted + t.free]
    return jnp.transpose(out, np.argsort(order))


@jax.tree_util.register_pytree_node_class
class Tracked:
    """A base weight on its way to a product: W, its adapters (None while probing), the
    leaf index, the view applied so far (a transpose `perm`, a cast `dtype`), and how many
    stack dims scans have sliced off (`depth`)."""

    def __init__(self, w, a, b, index, perm=None, dtype=None, depth=0):
        self.w, self.a, self.b, self.index, self.depth = w, a, b, index, depth
        self.perm = tuple(range(len(w.shape))) if perm is None else perm
        self.dtype = dtype

    def like(self, w=None, perm=None, dtype=None):
        """The same weight with another array, view or cast."""
        return Tracked(
            self.w if w is None else w, self.a, self.b, self.index, perm or self.perm, dtype or self.dtype, self.depth
        )

    def tree_flatten(self):
        return (self.w, self.a, self.b), (self.index, self.perm, self.dtype, self.depth)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def view(self, w=None):
        x = self.w if w is None else w
        x = jnp.transpose(x, self.perm) if self.perm != tuple(range(len(self.perm))) else x
        return x if self.dtype is None else x.astype(self.dtype)


@dataclasses.dataclass
class Ctx:
    uses: dict | None  # probing: where to record each candidate's uses
    index: dict | None  # evaluating: leaf index -> AdaptedWeight
    scale: float
    dropout: float = 0.0  # PEFT's lora_dropout on the adapters' input, where `key` is given
    key: Any = None
    calls: dict = dataclasses.field(default_factory=dict)  # products so far per weight (one mask each)

    def mask_key(self, index: int):
        """A key for the next product of weight `index`: one per weight, per use."""
        n = self.calls[index] = self.calls.get(index, -1) + 1
        return jax.random.fold_in(jax.random.fold_in(self.key, index), n)


def _is_array(x) -> bool:
    return isinstance(x, (jax.Array, np.ndarray, jax.ShapeDtypeStruct, jax.core.Tracer))


def split_dynamic(args, kwargs):
    """(the array leaves of `args`/`kwargs`, `rebuild(arrays) -> (args, kwargs)`): `make_jaxpr`
    traces the arrays only, so Python values (`train=True`) keep steering the model."""
    leaves, treedef = jax.tree.flatten((args, kwargs))
    mask = [_is_array(x) for x in leaves]

    def rebuild(dyn):
        it = iter(dyn)
        return jax.tree.unflatten(treedef, [next(it) if m else x for x, m in zip(leaves, mask)])

    return [x for x, m in zip(leaves, mask) if m], rebuild


def call(base_apply, params, rebuild, dyn, ctx: Ctx):
    """`base_apply(params, *args, **kwargs)` evaluated through its jaxpr with the `Tracked` leaves."""

    def program(p, d):
        a, k = rebuild(d)
        return base_apply(p, *a, **k)

    is_t = lambda x: isinstance(x, Tracked)  # noqa: E731
    plain = jax.tree.map(lambda t: t.w if is_t(t) else t, params, is_leaf=is_t)
    closed, out_shape = jax.make_jaxpr(program, return_shape=True)(plain, list(dyn))
    flat_in = jax.tree.leaves(params, is_leaf=is_t) + list(dyn)
    outs = _eval(closed.jaxpr, closed.consts, flat_in, ctx)
    return jax.tree.unflatten(jax.tree.structure(out_shape), [_value(o, ctx, "the output") for o in outs])


def _eval(jaxpr, consts, args, ctx: Ctx) -> list:
    """`jaxpr` on `args` (arrays or `Tracked`), eqn by eqn; a `Tracked` weight stays factored
    up to its products and is merged wherever else it goes (recorded while probing)."""
    env = {}

    def read(v):
        return v.val if isinstance(v, jcore.Literal) else env[v]

    for v, x in zip(jaxpr.constvars, consts):
        env[v] = x
    for v, x in zip(jaxpr.invars, args):
        env[v] = x
    for eqn in jaxpr.eqns:
        ins = [read(v) for v in eqn.invars]
        outs = _eqn(eqn, ins, ctx)
        for v, x in zip(eqn.outvars, outs):
            if not isinstance(v, jcore.DropVar):
                env[v] = x
    return [read(v) for v in jaxpr.outvars]


def _eqn(eqn, ins, ctx: Ctx) -> list:
    name, params = eqn.primitive.name, eqn.params
    tracked = [isinstance(x, Tracked) for x in ins]
    if not any(tracked):
        return _bind(eqn, ins)
    if name == "convert_element_type" and jnp.issubdtype(params["new_dtype"], jnp.floating):
        return [ins[0].like(dtype=params["new_dtype"])]
    if name == "transpose":
        return [ins[0].like(perm=tuple(ins[0].perm[p] for p in params["permutation"]))]
    if name in _HINTS:  # a layout hint or a copy of the weight: the adapters follow it unchanged
        t = ins[0]
        return [t.like(w=_bind(eqn, [t.w])[0] if t.perm == tuple(range(len(t.perm))) else None)]
    if name == "dot_general" and sum(tracked) == 1:
        return [_dot(eqn, ins, tracked.index(True), ctx)]
    if name in _INLINE:
        sub = params[_INLINE[name]]
        jaxpr, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
        return _eval(jaxpr, consts, ins, ctx)
    if name in _REMAT:
        body = lambda *xs: _eval(params["jaxpr"], (), xs, ctx)  # noqa: E731
        return list(jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])(*ins))
    if name == "scan":
        return _scan(eqn, ins, ctx)
    return _bind(eqn, [_value(x, ctx, name) for x in ins])


def _bind(eqn, ins) -> list:
    got = eqn.primitive.get_bind_params(eqn.params)
    subfuns, params = got if isinstance(got, tuple) else ((), got)
    out = eqn.primitive.bind(*subfuns, *ins, **params)
    return list(out) if eqn.primitive.multiple_results else [out]


def _value(x, ctx: Ctx, where: str):
    """`x` as a plain array: a `Tracked` weight merged (W + scale * A B), its use recorded."""
    if not isinstance(x, Tracked):
        return x
    if ctx.uses is not None:
        ctx.uses[x.index].append(("other", where))
        return x.view()
    delta = delta_weight(ctx.index[x.index], x.a, x.b, x.depth)
    return x.view((x.w.astype(jnp.float32) + ctx.scale * delta).astype(x.w.dtype))


def _dot(eqn, ins, ti: int, ctx: Ctx):
    """The product `x W` (or `W x`) as the model wrote it, plus scale * (x A) B laid out as its
    output; a batched product's batch dims pair the input with each index's adapter."""
    t, x = ins[ti], ins[1 - ti]
    (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
    tc, xc, tb, xb = (lc, rc, lb, rb) if ti == 0 else (rc, lc, rb, lb)
    w_dim = lambda d: t.perm[d] + t.depth  # noqa: E731  a view dim in W's dims, stack dims included
    contracted, batch = tuple(w_dim(d) for d in tc), tuple(w_dim(d) for d in tb)
    free = tuple(w_dim(d) for d in range(len(t.perm)) if d not in tc and d not in tb)
    out = _bind(eqn, [t.view(), x] if ti == 0 else [x, t.view()])[0]
    if ctx.uses is not None:
        use = ("dot", tuple(sorted(contracted)), tuple(sorted(free)), t.depth)
        ctx.uses[t.index].append(use + ((tuple(sorted(batch)),) if batch else ()))
        return out
    target = ctx.index[t.index]
    nb = len(batch)
    a_pos = [nb + target.contracted.index(d) for d in contracted]
    ab_pos = [target.batch.index(d) for d in batch]  # A's and B's batch dims, in the product's order
    xd = x
    if ctx.dropout and ctx.key is not None:  # inverted dropout of the adapter's input only
        keep = jax.random.bernoulli(ctx.mask_key(t.index), 1.0 - ctx.dropout, x.shape)
        xd = jnp.where(keep, x / jnp.asarray(1.0 - ctx.dropout, x.dtype), jnp.zeros((), x.dtype))
    # (batch..., x's free dims..., r), then (batch..., x's free dims..., W's free dims...)
    xa = lax.dot_general(xd, t.a.astype(x.dtype), ((tuple(xc), tuple(a_pos)), (tuple(xb), tuple(ab_pos))))
    xa = xa * jnp.asarray(ctx.scale, xa.dtype)
    nbatch = tuple(range(nb))
    d = lax.dot_general(xa, t.b.astype(x.dtype), (((xa.ndim - 1,), (nb,)), (nbatch, tuple(ab_pos))))
    n_x = d.ndim - len(free) - nb  # x's free dims
    order = list(range(nb + n_x)) + [nb + n_x + target.free.index(f) for f in free]
    d = jnp.transpose(d, order)
    if ti == 0:  # W on the left: its free dims come before x's
        d = jnp.transpose(d, list(nbatch) + list(range(nb + n_x, d.ndim)) + list(range(nb, nb + n_x)))
    return out + d.astype(out.dtype)


def _scan(eqn, ins, ctx: Ctx) -> list:
    """A scan whose inputs hold weights: a weight in the scanned inputs (a stack of layers) is
    sliced with its adapters, one layer per iteration; one in the constants is closed over."""
    p = eqn.params
    if "num_consts" in p:  # jax 0.10
        n_c, n_carry = p["num_consts"], p["num_carry"]
        consts, carry, xs = ins[:n_c], ins[n_c : n_c + n_carry], ins[n_c + n_carry :]
    else:  # jax 0.12: the inputs as a flat tree of (consts, carry, xs)
        consts, carry, xs = (list(g) for g in p["ft_in"].update(list(ins)).unpack())
    n_carry = len(carry)
    carry = [_value(x, ctx, "a scan's carry") for x in carry]
    xs = [_value(x, ctx, "scan") if isinstance(x, Tracked) and x.perm[0] != 0 else x for x in xs]
    pieces = [(x.w, x.a, x.b) if isinstance(x, Tracked) else x for x in xs]

    def body(c_i, x_in):
        c, i = c_i
        inner = ctx if ctx.key is None else dataclasses.replace(ctx, key=jax.random.fold_in(ctx.key, i), calls={})
        sliced = [
            Tracked(*piece, t.index, tuple(d - 1 for d in t.perm[1:]), t.dtype, t.depth + 1)
            if isinstance(t, Tracked)
            else piece
            for t, piece in zip(xs, x_in)
        ]
        outs = _eval(p["jaxpr"].jaxpr, p["jaxpr"].consts, list(consts) + list(c) + sliced, inner)
        outs = [_value(o, ctx, "a scan's output") for o in outs]
        return (outs[:n_carry], i + 1), outs[n_carry:]  # i: the layer, so each layer draws its own masks

    (c, _), ys = lax.scan(
        body, (carry, jnp.int32(0)), pieces, length=p["length"], reverse=p["reverse"], unroll=p["unroll"]
    )
    return list(c) + list(ys)
