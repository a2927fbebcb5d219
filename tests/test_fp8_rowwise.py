"""The rowwise FP8 recipe (`fsdp_jax.quant.fp8_rowwise`, torchtitan's `rowwise`, docs/fp8.md):
the forward and both gradients against the formula written with numpy / ml_dtypes, and the
tiny model's step on 8 devices against one device."""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_fp8 import batches, bf16, built, cfg_for, f32dot, operands, primal_and_vjp, run, tree_max_diff

from fsdp_jax.quant import fp8_rowwise

E4 = ml_dtypes.float8_e4m3fn


def np_cast(a, axis):
    """e4m3 of `a` scaled along `axis` by 448 / amax rounded down to a power of two (as f32), the scales."""
    a = np.asarray(a, np.float32)
    amax = np.abs(a).max(axis=axis, keepdims=True)
    s = np.where(amax > 0, np.float32(448.0) / np.where(amax > 0, amax, 1), 1).astype(np.float32)
    s = (s.view(np.int32) & np.int32(0x7F800000)).view(np.float32)  # the power of two at or below
    return np.clip(a * s, -448, 448).astype(E4).astype(np.float32), s


def test_rowwise_equals_its_reference_formula():
    """Forward, input and weight gradients bit for bit: each GEMM's operands cast along the dim
    it contracts (tokens over K, weight columns over K; then over N; then over M), power-of-two
    scales, f32 accumulation; rows of very different size keep their own scales."""
    x, w = operands(4)
    x = x * jnp.arange(1, x.shape[0] + 1, dtype=x.dtype)[:, None]  # rows 1x .. 32x apart
    g = (jax.random.normal(jax.random.key(9), (x.shape[0], w.shape[1])) * 1e-3).astype(jnp.bfloat16)

    def f(x, w):
        return fp8_rowwise.rowwise_matmul(x, w)

    y, vjp = primal_and_vjp(f, x, w)
    dx, dw = jax.jit(vjp)(g)
    xq, sx = np_cast(x, 1)
    wq, sw = np_cast(w, 0)
    want_y = bf16(bf16(f32dot(xq, wq)) * (np.float32(1.0) / (sx * sw)))
    gq, sg = np_cast(g, 1)
    vq, sv = np_cast(w, 1)
    want_dx = bf16(f32dot(gq, vq.T) * (np.float32(1.0) / (sg * sv.T)))
    uq, su = np_cast(x, 0)
    hq, sh = np_cast(g, 0)
    want_dw = bf16(f32dot(uq.T, hq) * (np.float32(1.0) / (su.T * sh)))
    for got, want in ((y, want_y), (dx, want_dx), (dw, want_dw)):
        assert got.dtype == jnp.bfloat16
        np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    assert len(np.unique(sx)) > 1 and np.all(np.log2(sx) == np.round(np.log2(sx)))  # per row, powers of two
    # the backward's GEMMs take e4m3 (no e5m2 in this recipe)
    text = str(jax.make_jaxpr(vjp)(g))
    assert "f8_e4m3fn" in text and "f8_e5m2" not in text


@pytest.mark.slow
def test_rowwise_step_on_8_devices_equals_one_device():
    """The tiny model, rowwise recipe, f32 compute, 3 SGD steps: full_shard and shard_opt on 8
    devices equal one device within the dense FP8 test's bounds, and differ from tensorwise."""
    cfg, data = cfg_for("rowwise"), batches(3)
    ref, ref_losses = run(built(cfg, "no_shard", 1), data)
    for strategy in ("full_shard", "shard_opt"):
        state, losses = run(built(cfg, strategy, 8), data)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, err_msg=strategy)
        assert tree_max_diff(state.params, ref.params) < 5e-4, strategy
    tensorwise, _ = run(
        built(dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, recipe="tensorwise")), "no_shard", 1), data
    )
    assert tree_max_diff(tensorwise.params, ref.params) > 0
