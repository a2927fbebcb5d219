"""Context-parallel attention (`fsdp_jax.attention.ring`) against one device's
dense masked attention: ring and all-gather K/V passing, zig-zag layout, packed segment
ids, sliding windows (all layers or a pattern's local flag), soft-capped scores,
grouped-query heads; values and gradients; and the compiled collectives of each."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fsdp_jax as fj
from fsdp_jax.attention.ring import context_attention
from fsdp_jax.errors import BatchError
from fsdp_jax.sharding.context import check_seq_len, unzigzag, zigzag, zigzag_order


def dense_reference(q, k, v, positions, seg, scale, cap=0.0, window=0, local=True):
    """Plain (B, S, S) masked softmax attention in row order, written independently."""
    b, s, h, dh = q.shape
    kk = jnp.repeat(k, h // k.shape[2], axis=2)
    vv = jnp.repeat(v, h // v.shape[2], axis=2)
    sc = jnp.einsum("bshd,bthd->bhst", q, kk) * scale
    if cap:
        sc = cap * jnp.tanh(sc / cap)
    i = jnp.arange(s)
    mask = (i[None, :] <= i[:, None])[None] & (seg[:, :, None] == seg[:, None, :])
    if window and local:
        mask = mask & ((i[:, None] - i[None, :]) < window)[None]
    sc = jnp.where(mask[:, None], sc, -jnp.inf)
    return jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(sc, axis=-1), vv)


def packed(b, s, seed=0):
    """Segment ids 1, 2, ... of random lengths (0 = padding at the end), positions restarting."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, s), np.int32)
    pos = np.zeros((b, s), np.int32)
    for r in range(b):
        cuts = np.sort(rng.choice(np.arange(1, s - 2), 3, replace=False))
        bounds = [0, *cuts, s - 2]  # the last 2 tokens are padding (segment 0)
        for n, (a, e) in enumerate(zip(bounds, bounds[1:])):
            seg[r, a:e] = n + 1
            pos[r, a:e] = np.arange(e - a)
        pos[r, s - 2 :] = np.arange(2)
    return jnp.asarray(seg), jnp.asarray(pos)


def test_zigzag_order_gives_each_rank_an_early_and_a_late_chunk():
    assert zigzag_order(8, 2).tolist() == [0, 1, 6, 7, 2, 3, 4, 5]
    assert zigzag_order(8, 4).tolist() == [0, 7, 1, 6, 2, 5, 3, 4]
    x = jnp.arange(24).reshape(2, 12)
    np.testing.assert_array_equal(unzigzag(zigzag(x, 3), 3), x)
    with pytest.raises(BatchError, match="divisible by 2 x context = 8"):
        check_seq_len(12, 4)


CASES = {
    "causal": dict(),
    "packed": dict(packed=True),
    "window": dict(packed=True, window=5),
    "softcap_mqa": dict(cap=3.0, kvh=1),
    "global_layer": dict(packed=True, window=5, local=False),
    "query_chunks": dict(packed=True, window=5, q_chunk=2),  # 8 local queries in chunks of 2
}


@pytest.mark.parametrize("kv_pass", ["ring", "all_gather"])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.fast_cases("causal-ring", "packed-ring", "window-ring", "query_chunks-ring")
def test_matches_one_device_values_and_grads(case, kv_pass):
    c = CASES[case]
    b, s, h, kvh, dh, n = 2, 32, 4, c.get("kvh", 2), 8, 4
    keys = jax.random.split(jax.random.key(3), 4)
    q = jax.random.normal(keys[0], (b, s, h, dh))
    k = jax.random.normal(keys[1], (b, s, kvh, dh))
    v = jax.random.normal(keys[2], (b, s, kvh, dh))
    w = jax.random.normal(keys[3], (b, s, h, dh))
    if c.get("packed"):
        seg, pos = packed(b, s)
    else:
        seg, pos = jnp.ones((b, s), jnp.int32), jnp.broadcast_to(jnp.arange(s), (b, s))
    scale, cap, window, local = dh**-0.5, c.get("cap", 0.0), c.get("window", 0), c.get("local", True)

    def ref_loss(q, k, v):
        return jnp.sum(dense_reference(q, k, v, pos, seg, scale, cap, window, local) * w)

    ref, ref_g = jax.jit(jax.value_and_grad(ref_loss, argnums=(0, 1, 2)))(q, k, v)
    mesh = fj.make_mesh(fsdp=2, context=n)

    def cp_loss(q, k, v, pos, seg, w):
        zq, zk, zv, zp, zs, zw = zigzag((q, k, v, pos, seg, w), n)
        o = context_attention(
            zq,
            zk,
            zv,
            zp,
            zs,
            scale=scale,
            softcap=cap,
            window=window,
            local=jnp.asarray(local) if window else None,
            kv_pass=kv_pass,
            q_chunk=c.get("q_chunk", 2048),
        )
        return jnp.sum(o * zw)

    act = NamedSharding(mesh, P("fsdp"))
    with jax.set_mesh(mesh):
        f = jax.jit(jax.value_and_grad(cp_loss, argnums=(0, 1, 2)), in_shardings=act)
        out, g = f(q, k, v, pos, seg, w)
        hlo = f.lower(q, k, v, pos, seg, w).compile().as_text()
    np.testing.assert_allclose(out, ref, rtol=1e-5)
    for a, r in zip(g, ref_g):
        np.testing.assert_allclose(a, r, rtol=1e-5, atol=1e-5)
    ops = set(re.findall(r"\b(collective-permute|all-gather|all-to-all)(?:-start)?\(", hlo))
    assert ("collective-permute" in ops) == (kv_pass == "ring"), ops
