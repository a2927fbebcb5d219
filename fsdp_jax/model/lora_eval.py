"""How `with_lora`'s wrapped apply runs the model: its jaxpr, eqn by eqn, with each
targeted weight kept factored (`Tracked`: W, A, B and the view taken of W) up to the
matrix products that use it, which compute x W + scale * (x A) B. Inner `jit`s and custom
derivatives are inlined where a weight flows in, `remat` is re-applied with its policy; a
weight going anywhere else is merged (W + scale * A B), and while probing that use is
recorded, so `with_lora` leaves such a weight without an adapter."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore

_INLINE = {"pjit": "jaxpr", "jit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr"}
_CUSTOM = {"custom_jvp_call": "call_jaxpr", "custom_vjp_call": "call_jaxpr", "custom_vjp_call_jaxpr": "fun_jaxpr"}
_REMAT = {"remat2", "checkpoint"}
_HINTS = {"sharding_constraint", "copy", "copy_p"}


@dataclasses.dataclass(frozen=True)
class Target:
    """A weight with an adapter: its path, shape, the dims its products contract and the
    shapes of A (contracted dims..., r) and B (r, free dims...)."""

    path: str
    shape: tuple[int, ...]
    contracted: tuple[int, ...]
    free: tuple[int, ...]
    a_shape: tuple[int, ...]
    b_shape: tuple[int, ...]


def delta_weight(t: Target, ad) -> jax.Array:
    """scale-free A B laid out as W (f32)."""
    a, b = ad["lora_a"].astype(jnp.float32), ad["lora_b"].astype(jnp.float32)
    ab = jnp.tensordot(a, b, axes=1)  # contracted dims..., free dims...
    order = list(t.contracted) + list(t.free)
    return jnp.transpose(ab, np.argsort(order))


@jax.tree_util.register_pytree_node_class
class Tracked:
    """A base weight on its way to a product: W, its adapters (None while probing), the
    leaf index, and the view applied so far (a transpose `perm`, a cast `dtype`)."""

    def __init__(self, w, a, b, index, perm=None, dtype=None):
        self.w, self.a, self.b, self.index = w, a, b, index
        self.perm = tuple(range(len(w.shape))) if perm is None else perm
        self.dtype = dtype

    def tree_flatten(self):
        return (self.w, self.a, self.b), (self.index, self.perm, self.dtype)

    @classmethod
    def tree_unflatten(cls, aux, children):
        return cls(*children, *aux)

    def view(self, w=None):
        x = self.w if w is None else w
        x = jnp.transpose(x, self.perm) if self.perm != tuple(range(len(self.perm))) else x
        return x if self.dtype is None else x.astype(self.dtype)

    @property
    def aval(self):
        shape = tuple(self.w.shape[p] for p in self.perm)
        return jax.core.ShapedArray(shape, self.dtype or self.w.dtype)


@dataclasses.dataclass
class Ctx:
    uses: dict | None  # probing: where to record each candidate's uses
    index: dict | None  # evaluating: leaf index -> Target
    scale: float


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
        t = ins[0]
        return [Tracked(t.w, t.a, t.b, t.index, t.perm, params["new_dtype"])]
    if name == "transpose":
        t = ins[0]
        return [Tracked(t.w, t.a, t.b, t.index, tuple(t.perm[p] for p in params["permutation"]), t.dtype)]
    if name in _HINTS:  # a layout hint or a copy of the weight: the adapters follow it unchanged
        t = ins[0]
        w = _bind(eqn, [t.w])[0] if t.perm == tuple(range(len(t.perm))) and name != "copy_p" else t.w
        return [Tracked(w, t.a, t.b, t.index, t.perm, t.dtype)]
    if name == "dot_general" and sum(tracked) == 1 and not any(params["dimension_numbers"][1]):
        return [_dot(eqn, ins, tracked.index(True), ctx)]
    if name in _INLINE:
        sub = params[_INLINE[name]]
        jaxpr, consts = (sub.jaxpr, sub.consts) if hasattr(sub, "consts") else (sub, ())
        return _eval(jaxpr, consts, ins, ctx)
    if name in _REMAT:
        body = lambda *xs: _eval(params["jaxpr"], (), xs, ctx)  # noqa: E731
        return list(jax.checkpoint(body, prevent_cse=params["prevent_cse"], policy=params["policy"])(*ins))
    if name in _CUSTOM and not ctx.uses:
        sub = params[_CUSTOM[name]]
        return _eval(sub.jaxpr, sub.consts, ins, ctx)
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
    t = ctx.index[x.index]
    return x.view(
        (x.w.astype(jnp.float32) + ctx.scale * delta_weight(t, {"lora_a": x.a, "lora_b": x.b})).astype(x.w.dtype)
    )


def _dot(eqn, ins, ti: int, ctx: Ctx):
    """The product `x W` (or `W x`) as the model wrote it, plus scale * (x A) B laid out as its output."""
    t, x = ins[ti], ins[1 - ti]
    (lc, rc), _ = eqn.params["dimension_numbers"]
    tc, xc = (lc, rc) if ti == 0 else (rc, lc)
    contracted = tuple(t.perm[d] for d in tc)
    free_view = [d for d in range(len(t.perm)) if d not in tc]
    free = tuple(t.perm[d] for d in free_view)
    out = _bind(eqn, [t.view(), x] if ti == 0 else [x, t.view()])[0]
    if ctx.uses is not None:
        ctx.uses[t.index].append(("dot", tuple(sorted(contracted)), tuple(sorted(free))))
        return out
    target = ctx.index[t.index]
    a_pos = [target.contracted.index(d) for d in contracted]
    xa = lax.dot_general(x, t.a.astype(x.dtype), ((tuple(xc), tuple(a_pos)), ((), ())))
    d = lax.dot_general(xa * jnp.asarray(ctx.scale, xa.dtype), t.b.astype(x.dtype), (((xa.ndim - 1,), (0,)), ((), ())))
    n_x = d.ndim - len(free)
    order = list(range(n_x)) + [n_x + target.free.index(f) for f in free]
    d = jnp.transpose(d, order)
    if ti == 0:  # W on the left: its free dims come first
        d = jnp.transpose(d, list(range(n_x, d.ndim)) + list(range(n_x)))
    return out + d.astype(out.dtype)
