"""The flash ring (`fsdp_jax.attention.flash`: one custom VJP over the whole ring, each
block a kernel returning (o, lse), blocks merged by log-sum-exp, the kernel's backward
fed the global o and lse) against one device's dense masked attention, in float32: loss
and gradients of q, k, v at context 2 and 4, ring and all-gather, causal, packed segment
ids, sliding windows (always, or a pattern's global layer), soft caps, grouped-query heads.
The block kernel here is the pure-JAX reference (`ring_kernels.reference_kernel`)."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_ring_attention import dense_reference, packed

import fsdp_jax as fj
from fsdp_jax.attention.flash import flash_context_attention
from fsdp_jax.attention.kernels import BlockKernel, merge, reference_kernel
from fsdp_jax.sharding.context import unzigzag, zigzag

CASES = {
    "causal": dict(),
    "packed": dict(packed=True),
    "window": dict(packed=True, window=5),
    "global_layer": dict(packed=True, window=5, local=False),
    "softcap_mqa": dict(packed=True, cap=3.0, kvh=1),
}


def inputs(c, b=2, s=32, h=4, dh=8, seed=3):
    keys = jax.random.split(jax.random.key(seed), 4)
    kvh = c.get("kvh", 2)
    q = jax.random.normal(keys[0], (b, s, h, dh))
    k = jax.random.normal(keys[1], (b, s, kvh, dh))
    v = jax.random.normal(keys[2], (b, s, kvh, dh))
    w = jax.random.normal(keys[3], (b, s, h, dh))
    if c.get("packed"):
        seg, pos = packed(b, s)
    else:
        seg = jnp.asarray(np.ones((b, s), np.int32))
        pos = jnp.asarray(np.broadcast_to(np.arange(s, dtype=np.int32), (b, s)))
    return q, k, v, w, pos, seg


def rel_err(a, r) -> float:
    """max |a - r| / max |r| in a's float32, on the host (eagerly on the devices, each op on
    each sharding and shape was a compiled program of its own)."""
    a, r = np.asarray(a), np.asarray(r)
    return float(np.max(np.abs(a - r)) / np.max(np.abs(r)))


def compiled_ring(c, kernel, n, kv_pass, args):
    """(f, compiled HLO): the ring's loss sum(o * w), its grads of q, k, v and o in row order,
    compiled once for args' shapes, f(q, k, v, w, pos, seg, local) -> ((loss, o), grads). The data
    (ids, positions, a pattern's traced `local` flag) are arguments: cases that differ only there
    call one program."""
    mesh = fj.make_mesh(fsdp=8 // n, context=n)

    def loss(q, k, v, w, pos, seg, local):
        zq, zk, zv, zp, zs, zw = zigzag((q, k, v, pos, seg, w), n)
        flag = local if c.get("window") else None
        o = flash_context_attention(zq, zk, zv, zp, zs, kernel=kernel, local=flag, kv_pass=kv_pass)
        return jnp.sum(o * zw), unzigzag(o, n)

    with jax.set_mesh(mesh):
        rows, scalar = NamedSharding(mesh, P("fsdp")), NamedSharding(mesh, P())
        f = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True), in_shardings=(rows,) * 6 + (scalar,))
        compiled = f.lower(*args, jnp.asarray(True)).compile()  # one compile: the values and the HLO

    def run(*a):
        with jax.set_mesh(mesh):
            return compiled(*a)

    return run, compiled.as_text()


def ring_value_and_grad(c, kernel, n, kv_pass, args, with_o=False, compiled=None):
    """(loss sum(o * w), grads of q, k, v, compiled HLO[, o in row order]); `compiled` a
    `compiled_ring` of the same kernel and shapes to call instead of compiling."""
    f, hlo = compiled or compiled_ring(c, kernel, n, kv_pass, args)
    (out, o), g = f(*args, jnp.asarray(c.get("local", True)))
    return (out, g, hlo, o) if with_o else (out, g, hlo)


@functools.partial(jax.jit, static_argnames=("cap", "window", "local"))
def _dense(q, k, v, w, pos, seg, *, cap, window, local):
    def loss(q, k, v):
        o = dense_reference(q, k, v, pos, seg, q.shape[-1] ** -0.5, cap, window, local)
        return jnp.sum(o * w), o

    return jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True)(q, k, v)


def dense_value_and_grad(c, args, with_o=False):
    """One device's loss, grads (and o); compiled once per shape and (cap, window, local) in this
    process: the ids and weights are arguments."""
    q, k, v, w, pos, seg = args
    (out, o), g = _dense(
        q, k, v, w, pos, seg, cap=c.get("cap", 0.0), window=c.get("window", 0), local=c.get("local", True)
    )
    return (out, g, o) if with_o else (out, g)


# The cases each ring program checks: within a group they differ only in data (segment ids,
# positions, the pattern's traced `local` flag), so one compiled ring serves the group.
PROGRAMS = {"causal": ("causal", "packed"), "window": ("window", "global_layer"), "softcap_mqa": ("softcap_mqa",)}


@pytest.mark.parametrize("kv_pass", ["ring", "all_gather"])
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("program", PROGRAMS)
@pytest.mark.fast_cases("causal-2-ring", "causal-4-all_gather", "window-2-ring", "softcap_mqa-2-ring")
def test_reference_kernel_ring_matches_one_device(program, n, kv_pass):
    compiled = None
    for case in PROGRAMS[program]:
        c = CASES[case]
        args = inputs(c, b=8 // n)  # one row per fsdp rank
        kern = reference_kernel(scale=args[0].shape[-1] ** -0.5, softcap=c.get("cap", 0.0), window=c.get("window", 0))
        compiled = compiled or compiled_ring(c, kern, n, kv_pass, args)
        _, g, hlo, o = ring_value_and_grad(c, kern, n, kv_pass, args, with_o=True, compiled=compiled)
        _, ref_g, o_ref = dense_value_and_grad(c, args, with_o=True)
        # o element by element and the grads (relative to their largest); the loss sum(o * w) is
        # only the grads' probe: its terms of either sign nearly cancel (1.1e-5 apart at context 2)
        for name, a, r in zip("oqkv", (o, *g), (o_ref, *ref_g)):
            err = rel_err(a, r)
            assert err <= 1e-5, (case, name, err)
    ops = re.findall(r"\b(collective-permute|all-gather|reduce-scatter|all-reduce)(?:-start)?\(", hlo)
    if kv_pass == "ring":  # K/V hops forward, K/V and dK/dV hops backward, nothing gathered
        assert "collective-permute" in ops and "all-gather" not in ops, sorted(set(ops))
    else:  # K/V gathered (forward and backward); dK/dV summed back over context
        assert "collective-permute" not in ops and "all-gather" in ops, sorted(set(ops))


def test_merge_by_log_sum_exp_equals_one_softmax():
    """Two halves of the keys, each normalised with its own lse, merge to the softmax over
    all keys; an empty block (lse -inf) changes nothing."""
    # each piece compiled whole (eagerly, each op was a program: 46 compiles); both merges are
    # the one compiled `merge`, as in the ring
    s = np.asarray(jax.random.normal(jax.random.key(0), (3, 10)))
    v = np.asarray(jax.random.normal(jax.random.key(1), (10, 4)))

    @jax.jit
    def part(s, v):
        lse = jax.nn.logsumexp(s, axis=-1)
        return jnp.exp(s - lse[:, None]) @ v, lse

    one_softmax = jax.jit(lambda s, v: (jax.nn.softmax(s) @ v, jax.nn.logsumexp(s, axis=-1)))
    merged = jax.jit(merge)
    o, lse = merged(part(s[:, :4], v[:4]), part(s[:, 4:], v[4:]))
    want_o, want_lse = one_softmax(s, v)
    np.testing.assert_allclose(o, want_o, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, rtol=1e-6)
    o2, lse2 = merged((o, lse), (np.zeros(o.shape, o.dtype), np.full(lse.shape, -np.inf, lse.dtype)))
    np.testing.assert_array_equal(o2, o)
    np.testing.assert_array_equal(lse2, lse)


def test_kernel_must_be_a_block_kernel():
    q = jnp.zeros((2, 8, 2, 4))
    with pytest.raises(TypeError, match="BlockKernel"):
        flash_context_attention(q, q, q, jnp.zeros((2, 8), jnp.int32), kernel=lambda *a: a)
    assert isinstance(reference_kernel(scale=0.5), BlockKernel)
