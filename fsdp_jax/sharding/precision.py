"""Mixed-precision policy: fp32 master weights, low-precision compute.

`Policy(param_dtype, compute_dtype, reduce_dtype, output_dtype)` parses from a
string such as ``"params=float32,compute=bfloat16,reduce=float32"``. Fields left
out default to float32, so gradient reductions and the loss stay accurate unless
asked otherwise.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import jax
import jax.numpy as jnp

from fsdp_jax.sharding.mesh import constrain
from fsdp_jax.sharding.precision_names import dtype_name, matmul_name, split_fields


def _dtype(name) -> jnp.dtype:
    if not isinstance(name, str):
        name = jnp.dtype(name).name
    return jnp.dtype(dtype_name(name))


@dataclasses.dataclass(frozen=True)
class Policy:
    """param_dtype: master weights and optimizer state (`fsdp_jax.train.build` and
    `shard_model(precision=...)` store floating params in it). compute_dtype: params and
    activations in forward/backward. reduce_dtype: gradients when reduced across
    devices. output_dtype: the loss and metrics. frozen_dtype: params the step does not
    train (`trainable`, LoRA's base): stored in it, with no master copy (None: the
    compute dtype, the only dtype a frozen param is ever used in). matmul: "fp8" runs the
    model's projections as scaled FP8 matmuls (`fsdp_jax.quant.fp8`, docs/fp8.md), None
    (or "compute") in the compute dtype."""

    param_dtype: jnp.dtype = jnp.dtype("float32")
    compute_dtype: jnp.dtype = jnp.dtype("float32")
    reduce_dtype: jnp.dtype = jnp.dtype("float32")
    output_dtype: jnp.dtype = jnp.dtype("float32")
    frozen_dtype: jnp.dtype | None = None
    matmul: str | None = None

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "matmul":
                object.__setattr__(self, f.name, matmul_name(v))
            elif v is not None or f.name != "frozen_dtype":
                object.__setattr__(self, f.name, _dtype(v))

    @property
    def frozen_storage_dtype(self) -> jnp.dtype:
        """The dtype frozen params rest in: `frozen_dtype`, else the compute dtype."""
        return self.compute_dtype if self.frozen_dtype is None else self.frozen_dtype

    @classmethod
    def parse(cls, spec: "str | Policy | None") -> "Policy":
        """Parse ``"params=float32,compute=bfloat16"``; a bare dtype sets compute only."""
        if spec is None or isinstance(spec, Policy):
            return spec or cls()
        kwargs = split_fields(spec)  # ValueError naming an unknown key (`precision_names`)
        return cls(**kwargs)

    def __str__(self) -> str:
        return (
            f"params={self.param_dtype.name},compute={self.compute_dtype.name},"
            f"reduce={self.reduce_dtype.name},output={self.output_dtype.name}"
            + ("" if self.frozen_dtype is None else f",frozen={self.frozen_dtype.name}")
            + ("" if self.matmul is None else f",matmul={self.matmul}")
        )

    def cast_to_compute(self, tree):
        return _cast_floats(tree, self.compute_dtype)


def _cast_floats(tree, dtype):
    return jax.tree.map(lambda x: x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x, tree)


def cast_params_for_compute(params, policy: Policy, shardings):
    """Cast `params` to the compute dtype *in their sharded layout* (so the
    all-gathers XLA inserts afterwards move compute-dtype bytes); in the backward
    pass, gradients are cast to the reduce dtype and constrained to the same
    layout, so their cross-device reduction runs in the reduce dtype.
    """
    leaves, treedef = jax.tree.flatten(params)
    shard_leaves = treedef.flatten_up_to(shardings)
    out = [cast_leaf(x, s, policy.compute_dtype, policy.reduce_dtype) for x, s in zip(leaves, shard_leaves)]
    return jax.tree.unflatten(treedef, out)


def cast_leaf(x, sharding, compute_dtype, reduce_dtype):
    """One leaf of `cast_params_for_compute`."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return constrain(x, sharding)
    return _make_cast(sharding, jnp.dtype(compute_dtype), jnp.dtype(reduce_dtype))(x)


@functools.lru_cache(maxsize=None)
def _make_cast(sharding, compute_dtype, reduce_dtype):
    @jax.custom_vjp
    def cast_for_compute(x):
        return constrain(x.astype(compute_dtype), sharding)

    def fwd(x):
        return cast_for_compute(x), jnp.zeros((), x.dtype)  # residual carries only the dtype

    def bwd(res, g):
        g = constrain(g.astype(reduce_dtype), sharding)
        return (g.astype(res.dtype),)

    cast_for_compute.defvjp(fwd, bwd)
    return cast_for_compute


# ----------------------------------------------------------------------------- weight matmuls

_REDUCE: list = []


@contextlib.contextmanager
def reducing(policy: Policy | None):
    """While a train step's loss is traced: `matmul` makes weight grads in `policy`'s
    reduce dtype (None: plain matmuls)."""
    _REDUCE.append(None if policy is None else policy.reduce_dtype)
    try:
        yield
    finally:
        _REDUCE.pop()


def step_reduce_dtype():
    """The reduce dtype of the train step being traced (None outside one, or without a
    policy): what a custom weight matmul (`fsdp_jax.quant.fp8`) makes its weight grad in."""
    return _REDUCE[-1] if _REDUCE else None


def widens(policy: Policy) -> bool:
    """Does `policy` reduce grads in a wider float dtype than it computes in?"""
    return policy.reduce_dtype.itemsize > policy.compute_dtype.itemsize


def matmul(x, w):
    """`x @ w` for a 2-D weight `w`. Inside a train step whose reduce dtype is wider than
    `w`'s (`reduce=float32` under bf16 compute), `w`'s gradient comes from a dot whose
    output is in the reduce dtype, cast to `w`'s dtype only behind an optimization barrier,
    so XLA's partitioner reduces it across devices (the per-layer reduce-scatter) in the
    reduce dtype, as PyTorch FSDP's reduce_dtype does. (A cast right after the dot is folded
    into it by XLA, and JAX's own transpose casts a weight grad to the weight's dtype.)"""
    r = _REDUCE[-1] if _REDUCE else None
    if r is None or not jnp.issubdtype(w.dtype, jnp.floating) or r.itemsize <= w.dtype.itemsize:
        return x @ w
    return _make_matmul(jnp.dtype(r))(x, w)


@functools.lru_cache(maxsize=None)
def _make_matmul(reduce_dtype):
    @jax.custom_vjp
    def mm(x, w):
        return x @ w

    def fwd(x, w):
        return x @ w, (x, w)

    def bwd(res, g):
        x, w = res
        dx = jax.lax.dot_general(g, w, (((g.ndim - 1,), (1,)), ((), ()))).astype(x.dtype)
        lead = tuple(range(x.ndim - 1))
        dw = jax.lax.dot_general(x, g, ((lead, lead), ((), ())), preferred_element_type=reduce_dtype)
        return dx, jax.lax.optimization_barrier(dw).astype(w.dtype)

    mm.defvjp(fwd, bwd)
    return mm


TAKE_UPDATES = "take_updates"  # the name scope of `take`'s cotangent layout (in HLO op names)


def take(table, ids, grad_layout=lambda g: g, updates_layout=None):
    """`table[ids]` (an embedding lookup), whose table gradient is, as `matmul`'s weight
    gradient, summed in the reduce dtype inside a train step that asks for a wider one;
    `grad_layout(g)` lays that gradient out (a sharding constraint to the table's at-rest
    layout) before its cast to the table's dtype, so its reduction is a reduce-scatter
    in the reduce dtype (unconstrained, XLA:GPU all-reduces the full table).
    `updates_layout(dy)` lays out the output's cotangent (ids.shape + (D,)) before its
    scatter-add: a layout the table's grad layout is one all-to-all away from (left to the
    partitioner, a batch sharded over data x fsdp meeting a table sharded over fsdp and
    replicated over data was rematerialised whole on every device)."""
    r = _REDUCE[-1] if _REDUCE else None
    if not jnp.issubdtype(table.dtype, jnp.floating):
        return jnp.take(table, ids, axis=0)
    wider = r is not None and r.itemsize > table.dtype.itemsize
    if not wider and updates_layout is None:
        return jnp.take(table, ids, axis=0)
    reduce_dtype = jnp.dtype(r) if wider else table.dtype
    updates_layout = updates_layout or (lambda g: g)

    @jax.custom_vjp
    def lookup(table, ids):
        return jnp.take(table, ids, axis=0)

    def fwd(table, ids):
        return lookup(table, ids), (jnp.zeros((0,) + table.shape, table.dtype), ids)

    def bwd(res, g):
        shaped, ids = res
        # the lookup's own transpose (a scatter-add), over a table in the reduce dtype
        _, vjp = jax.vjp(lambda t: jnp.take(t, ids, axis=0), jnp.zeros(shaped.shape[1:], reduce_dtype))
        with jax.named_scope(TAKE_UPDATES):  # the all-to-all it asks for is named as the lookup's
            g = updates_layout(g)
        (dt,) = vjp(g.astype(reduce_dtype))
        return grad_layout(dt.astype(shaped.dtype)), None

    lookup.defvjp(fwd, bwd)
    return lookup(table, ids)


def lay_out_for_compute(tree, compute, rest):
    """`tree` (at rest in `rest`, a matching tree of shardings) constrained to `compute`,
    with a backward that constrains the cotangent to `rest` directly (not to `compute`
    first): with `matmul`'s barrier between the dot and that constraint, XLA:GPU would
    otherwise all-reduce the full gradient and slice it instead of reduce-scattering it."""
    leaves, treedef = jax.tree.flatten(tree)
    pairs = zip(leaves, treedef.flatten_up_to(compute), treedef.flatten_up_to(rest))
    return jax.tree.unflatten(treedef, [x if c == r else _make_layout(c, r)(x) for x, c, r in pairs])


@functools.lru_cache(maxsize=None)
def _make_layout(compute, rest):
    @jax.custom_vjp
    def lay_out(x):
        return constrain(x, compute)

    lay_out.defvjp(lambda x: (lay_out(x), None), lambda _, g: (constrain(g, rest),))
    return lay_out
