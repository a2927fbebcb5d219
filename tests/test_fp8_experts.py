"""Routed experts in FP8 (`fsdp_jax.quant.fp8_experts`, docs/fp8.md): each expert's GEMM
against the reference formula (numpy / ml_dtypes casts, a scale per expert) forward and
backward, in both layouts; the tiny MoE model under every strategy against one device."""

import collections
import dataclasses
import functools
import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from test_fp8 import STRATEGIES, batches, bf16, built, f32dot, primal_and_vjp, run, tree_max_diff
from test_hf import GOLDEN

from fsdp_jax.app.config.policy_checks import check_fp8_gather
from fsdp_jax.app.config.schema import Config, Fp8Config
from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.checkpoint import Checkpointer
from fsdp_jax.errors import ConfigError
from fsdp_jax.quant import fp8_experts, fp8_rowwise_experts

E4, E5 = ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e5m2
SIZES = (5, 0, 9, 6)  # expert 1 gets no rows; 4 rows past the groups belong to none
M, K, N = 24, 32, 16


def np_q(x, amax, dtype):
    """The cast with a scale from `amax`: (x * (max / amax) saturated to `dtype`, that scale)."""
    top = np.float32(ml_dtypes.finfo(dtype).max)
    s = top / np.float32(amax) if amax > 0 else np.float32(1.0)
    return np.clip(np.asarray(x, np.float32) * s, -top, top).astype(dtype).astype(np.float32), s


def reference(x, w, g, groups, hist=None):
    """y, dx, dw per expert, `groups` its rows: each expert scaled by its own amaxes (with
    `hist` (E, 3, L): by the max of its input / weight / gradient history, the current amax
    where that is all zeros), f32 accumulation, the forward GEMM written in bf16 then unscaled
    in f32, as docs/fp8.md writes."""
    x, w, g = (np.asarray(a, np.float32) for a in (x, w, g))
    y, dx, dw = np.zeros((len(x), w.shape[-1])), np.zeros_like(x), np.zeros_like(w)

    def ref(e, j, current):
        past = 0.0 if hist is None else float(np.max(hist[e, j]))
        return past if past > 0 else current

    for e, rows in enumerate(groups):
        if not len(x[rows]):
            continue
        xq, sx = np_q(x[rows], ref(e, 0, np.abs(x[rows]).max()), E4)
        wq, sw = np_q(w[e], ref(e, 1, np.abs(w[e]).max()), E4)
        gq, sg = np_q(g[rows], ref(e, 2, np.abs(g[rows]).max()), E5)
        y[rows] = bf16(bf16(f32dot(xq, wq)) * (np.float32(1.0) / (sx * sw)))
        dx[rows] = bf16(f32dot(gq, wq.T) * (np.float32(1.0) / (sg * sw)))
        dw[e] = bf16(f32dot(xq.T, gq) * (np.float32(1.0) / (sx * sg)))
    return y, dx, dw


def _no_expert_rows(g, start):
    """`g` with its rows from `start` on zero, set on the host (not an eager scatter's compiles;
    device_put, as jnp.asarray lifts a host array by a compiled `stage` per shape)."""
    h = np.asarray(g).copy()
    h[start:] = 0
    return jax.device_put(h)


@functools.partial(jax.jit, static_argnums=(0, 1, 2))
def _operands(shape_x, shape_w, shape_g):
    """(x, w, g): one compile per layout, not one per op of an eager draw."""
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = (jax.random.normal(kx, shape_x) * 3.0).astype(jnp.bfloat16)
    w = (jax.random.normal(kw, shape_w) * 0.02 * jnp.arange(1, shape_w[0] + 1)[:, None, None]).astype(jnp.bfloat16)
    g = (jax.random.normal(kg, shape_g) * 1e-3).astype(jnp.bfloat16)
    return x, w, g


@pytest.mark.parametrize("layout", ["grouped", "batched"])
def test_expert_gemms_equal_their_reference_formula(layout):
    """Forward and both gradients bit for bit against the formula with a scale per expert
    (experts' weights of different sizes, an expert without rows, rows in no expert); the
    backward's GEMMs take e5m2, the forward's none."""
    if layout == "grouped":
        x, w, g = _operands((M, K), (len(SIZES), K, N), (M, N))
        sizes = jax.device_put(np.asarray(SIZES, np.int32))

        def f(x, w):
            return fp8_experts.grouped_matmul(x, w, sizes)

        ends = np.cumsum(SIZES)
        groups = [np.arange(e - s, e) for s, e in zip(SIZES, ends)]
        g = _no_expert_rows(g, int(ends[-1]))  # rows in no expert: no output, no gradient
    else:
        x, w, g = _operands((3, 8, K), (3, K, N), (3, 8, N))
        f = fp8_experts.batched_matmul
        groups = [np.arange(8 * e, 8 * e + 8) for e in range(3)]
    y, vjp = primal_and_vjp(f, x, w)
    dx, dw = jax.jit(vjp)(g)

    def flat(a):
        return np.asarray(a, np.float32).reshape(M if layout == "grouped" else 24, -1)

    want_y, want_dx, want_dw = reference(flat(x), np.asarray(w, np.float32), flat(g), groups)
    assert y.dtype == dx.dtype == dw.dtype == jnp.bfloat16
    np.testing.assert_array_equal(flat(y), want_y)
    np.testing.assert_array_equal(flat(dx), want_dx)
    np.testing.assert_array_equal(np.asarray(dw, np.float32), want_dw)
    # one scale per expert, not one per tensor: expert 0's small weights keep their precision
    assert np.abs(np.asarray(w, np.float32)[0]).max() < 0.4 * np.abs(np.asarray(w, np.float32)).max()
    text = str(jax.make_jaxpr(vjp)(g))
    assert "f8_e5m2" in text and "f8_e4m3fn" in text
    assert "f8_e5m2" not in str(jax.make_jaxpr(f)(x, w))


@pytest.mark.parametrize("layout", ["grouped", "batched"])
def test_expert_histories_scale_by_the_past_and_push_through_the_backward(layout):
    """Delayed recipe, a history per expert for input, weight and gradient: each GEMM scaled
    by its expert's history max (the current amax where the history is all zeros: expert 0),
    bit for bit against the formula; the histories' cotangent is each with this call's amax
    pushed in front (0 for an expert without rows)."""
    if layout == "grouped":
        x, w, g = _operands((M, K), (len(SIZES), K, N), (M, N))
        sizes = jax.device_put(np.asarray(SIZES, np.int32))
        ends = np.cumsum(SIZES)
        groups = [np.arange(e - s, e) for s, e in zip(SIZES, ends)]
        g = _no_expert_rows(g, int(ends[-1]))

        def f(x, w, h):
            return fp8_experts.grouped_matmul(x, w, sizes, h)
    else:
        x, w, g = _operands((3, 8, K), (3, K, N), (3, 8, N))
        groups = [np.arange(8 * e, 8 * e + 8) for e in range(3)]
        f = fp8_experts.batched_matmul
    n_e = w.shape[0]
    past = np.asarray([[6.0, 0.09, 2e-3], [5.0, 0.2, 1e-3], [9.0, 0.1, 4e-3], [4.0, 0.3, 3e-3]], np.float32)[:n_e]
    hist = np.zeros((n_e, 3, 3), np.float32)
    hist[1:, :, 1] = past[1:]  # expert 0: all zeros
    y, vjp = primal_and_vjp(f, x, w, jnp.asarray(hist))
    dx, dw, new = jax.jit(vjp)(g)

    def flat(a):
        return np.asarray(a, np.float32).reshape(M if layout == "grouped" else 24, -1)

    want_y, want_dx, want_dw = reference(flat(x), np.asarray(w, np.float32), flat(g), groups, hist)
    np.testing.assert_array_equal(flat(y), want_y)
    np.testing.assert_array_equal(flat(dx), want_dx)
    np.testing.assert_array_equal(np.asarray(dw, np.float32), want_dw)
    # and the histories were used: the current-amax formula differs
    assert not np.array_equal(flat(dx), reference(flat(x), np.asarray(w, np.float32), flat(g), groups)[1])
    fx, fw, fg = flat(x), np.asarray(w, np.float32), flat(g)
    for e, rows in enumerate(groups):
        now = [np.abs(a).max() if a.size else 0.0 for a in (fx[rows], fw[e], fg[rows])]
        np.testing.assert_array_equal(np.asarray(new)[e, :, 0], np.asarray(now, np.float32))
        np.testing.assert_array_equal(np.asarray(new)[e, :, 1:], hist[e, :, :2])


def p2q(a, axis):
    """`a` cast to e4m3 along `axis` with power-of-two scales `2^floor(log2(448 / amax))` (1
    for an amax of 0): (the e4m3 values as f32, the scales with `axis` kept)."""
    a = np.asarray(a, np.float32)
    amax = np.abs(a).max(axis=axis, keepdims=True)
    s = np.where(amax > 0, np.float32(448.0) / np.where(amax > 0, amax, 1), 1).astype(np.float32)
    s = np.ldexp(np.float32(1.0), np.frexp(s)[1] - 1).astype(np.float32)
    return np.clip(a * s, -448, 448).astype(E4).astype(np.float32), s


def rowwise_reference(x, w, g, groups):
    """y, dx, dw per expert with rowwise scales (fp8_rowwise_experts' docstring), numpy / ml_dtypes."""
    x, w, g = (np.asarray(a, np.float32) for a in (x, w, g))
    y, dx, dw = np.zeros((len(x), w.shape[-1])), np.zeros_like(x), np.zeros_like(w)
    one = np.float32(1.0)
    for e, rows in enumerate(groups):
        if not len(rows):
            continue
        (xq, sx), (wq, sw) = p2q(x[rows], 1), p2q(w[e], 0)
        y[rows] = bf16(bf16(f32dot(xq, wq)) * (one / (sx * sw)))
        (gq, sg), (vq, sv) = p2q(g[rows], 1), p2q(w[e], 1)
        dx[rows] = bf16(f32dot(gq, vq.T) * (one / (sg * sv.T)))
        (uq, su), (hq, sh) = p2q(x[rows], 0), p2q(g[rows], 0)
        dw[e] = bf16(f32dot(uq.T, hq) * (one / (su.T * sh)))
    return y, dx, dw


@pytest.mark.parametrize("layout", ["grouped", "batched"])
@pytest.mark.slow
def test_rowwise_expert_gemms_equal_their_reference_formula(layout):
    """`fp8.recipe: rowwise` for the experts: every operand e4m3 with power-of-two scales
    along the dim its GEMM contracts (per row; per expert and column), bit for bit against
    numpy / ml_dtypes; no e5m2 anywhere."""
    if layout == "grouped":
        x, w, g = _operands((M, K), (len(SIZES), K, N), (M, N))
        sizes = jax.device_put(np.asarray(SIZES, np.int32))
        ends = np.cumsum(SIZES)
        groups = [np.arange(e - s, e) for s, e in zip(SIZES, ends)]
        g = _no_expert_rows(g, int(ends[-1]))

        def f(x, w):
            return fp8_rowwise_experts.grouped_matmul(x, w, sizes)
    else:
        x, w, g = _operands((3, 8, K), (3, K, N), (3, 8, N))
        groups = [np.arange(8 * e, 8 * e + 8) for e in range(3)]
        f = fp8_rowwise_experts.batched_matmul
    y, vjp = primal_and_vjp(f, x, w)
    dx, dw = jax.jit(vjp)(g)

    def flat(a):
        return np.asarray(a, np.float32).reshape(M if layout == "grouped" else 24, -1)

    want_y, want_dx, want_dw = rowwise_reference(flat(x), np.asarray(w, np.float32), flat(g), groups)
    np.testing.assert_array_equal(flat(y), want_y)
    np.testing.assert_array_equal(flat(dx), want_dx)
    np.testing.assert_array_equal(np.asarray(dw, np.float32), want_dw)
    # not the tensorwise recipe: its results differ
    assert not np.array_equal(flat(dx), reference(flat(x), np.asarray(w, np.float32), flat(g), groups)[1])
    text = str(jax.make_jaxpr(vjp)(g))
    assert "f8_e4m3fn" in text and "f8_e5m2" not in text


MOE = DecoderConfig(
    vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16,
    n_experts=8, experts_per_token=2, moe_ffn_dim=48, norm_topk_prob=True,
)  # fmt: skip


def moe_cfg(recipe="tensorwise"):
    return dataclasses.replace(
        Config(),
        model=MOE,
        precision="params=float32,compute=float32,matmul=fp8",
        fp8=Fp8Config(recipe=recipe, amax_history=4, emulate=True),
    )


def moe_variant(recipe="tensorwise", *, ep=False, gather=None):
    """`moe_cfg(recipe)`; `ep`: the experts split over `data` (all-to-all); `gather`: fp8.gather
    (None: the config's default)."""
    cfg = moe_cfg(recipe)
    if ep:
        cfg = dataclasses.replace(
            cfg, mesh=dataclasses.replace(cfg.mesh, rules={**dict(cfg.mesh.rules), "expert": "data"})
        )
    return cfg if gather is None else dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, gather=gather))


@functools.cache
def moe_build(recipe, strategy, n_devices, *, ep=False, gather=None):
    """One build per (variant, strategy, devices) in this file: the parity runs and the lowered-step
    checks of the same variant share it (one trace of its step; BENCHMARKS.md "Issue 55 item 6,
    test_fp8*")."""
    return built(moe_variant(recipe, ep=ep, gather=gather), strategy, n_devices)


@functools.cache
def moe_run(recipe, strategy, n_devices, steps, *, ep=False, gather=None):
    """`run` of `moe_build(...)` over `batches(steps)`, once per file: (state on the host, losses).
    The tensorwise one-device run is both the every-strategy test's reference and the rowwise
    test's other recipe."""
    return run(moe_build(recipe, strategy, n_devices, ep=ep, gather=gather), batches(steps))


@pytest.mark.slow
def test_every_strategy_equals_one_device_with_fp8_experts():
    """The tiny MoE (8 experts, top-2, dropless) with FP8 attention and experts, f32 compute,
    3 SGD steps: the five strategies on 8 devices, and experts split over `data` (all-to-all),
    agree with each other and with one device
    within the dense FP8 test's bounds (each expert's amax is taken over all of its rows,
    whichever device holds them); and the experts are FP8 (the run differs from matmul=compute
    by more than those bounds)."""
    cfg, data = moe_cfg(), batches(3)
    ref, ref_losses = moe_run("tensorwise", "no_shard", 1, 3)
    plain, _ = run(built(dataclasses.replace(cfg, precision="params=float32,compute=float32"), "no_shard", 1), data)

    def experts(p):
        return [p["segments"][0]["layers"][0]["moe"][k] for k in ("w_gate", "w_up", "w_down")]

    first, worst = None, 0.0
    for strategy in STRATEGIES:
        state, losses = run(moe_build("tensorwise", strategy, 8), data)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, err_msg=strategy)
        assert tree_max_diff(state.params, ref.params) < 5e-4, strategy
        worst = max(worst, tree_max_diff(experts(state.params), experts(ref.params)))
        first = first or state
        assert tree_max_diff(state, first) < 1e-6, strategy
    # experts over `data` (2 x fsdp 4): an expert's rows arrive by all-to-all from its data
    # group and are spread over fsdp, the axis its amaxes are maxed over (measured: params 7.5e-9)
    state, losses = run(moe_build("tensorwise", "hybrid_shard", 8, ep=True), data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    worst = max(worst, tree_max_diff(experts(state.params), experts(ref.params)))
    assert tree_max_diff(state.params, ref.params) < 5e-4
    # measured: 3.7e-9 between layouts, 5.2e-5 between FP8 and f32 experts
    assert tree_max_diff(experts(ref.params), experts(plain.params)) > 10 * worst


@pytest.mark.slow
def test_expert_histories_equal_one_device_and_resume_exactly(tmp_path):
    """Delayed recipe on the tiny MoE (f32 compute, 4 SGD steps): full_shard on 8 devices and
    the experts split over `data` (all-to-all) equal one device (loss, params, and the
    per-expert histories of input, weight and gradient, which every step writes); and 2 steps,
    a checkpoint, its restore and 2 more steps equal 4 straight steps bit for bit."""
    cfg, data = moe_cfg("delayed"), batches(4)

    def hists(state):
        flat = jax.tree_util.tree_flatten_with_path(state.model_state)[0]
        return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat if "moe" in jax.tree_util.keystr(p)}

    ref, ref_losses = run(built(cfg, "no_shard", 1), data)
    assert len(hists(ref)) == 3  # w_gate, w_up, w_down: (layers, E, 3, L)
    for h in hists(ref).values():
        assert h.shape[-3:] == (8, 3, 4) and h[..., 1, :].all()  # weights: every expert, every step
        assert h[..., 2, :].any()
    b = built(cfg, "full_shard", 8)
    runs = {"full_shard": run(b, data), "hybrid_shard": run(moe_build("delayed", "hybrid_shard", 8, ep=True), data)}
    for strategy, (state, losses) in runs.items():
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, err_msg=strategy)
        assert tree_max_diff(state.params, ref.params) < 5e-4, strategy
        for k, h in hists(state).items():
            np.testing.assert_allclose(h, hists(ref)[k], rtol=1e-2, err_msg=f"{strategy} {k}")
    straight = runs["full_shard"][0]  # 4 steps straight: the full_shard run above (the same build, the same data)
    state = b.init_state(jax.random.key(0))
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        for batch in data[:2]:
            state, _ = b.train_step(state, batch)
        ckpt.save(2, state)
    restored = Checkpointer(tmp_path / "ckpt", read_only=True).restore(b.abstract_state).state
    for h in hists(jax.device_get(restored)).values():
        assert h[..., 1, :2].all() and not h[..., 2:].any()  # 2 steps pushed
    for batch in data[2:]:
        restored, _ = b.train_step(restored, batch)
    for x, y in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@pytest.mark.slow
def test_rowwise_experts_equal_one_device():
    """`fp8.recipe: rowwise` on the tiny MoE (f32 compute, 3 SGD steps): full_shard on 8
    devices and the experts split over `data` (all-to-all), both through the experts' f8 weight
    gathers (the default), equal one device (the weight gradient's per-expert column scales are
    maxed over every device holding an expert's rows; the weight's scales over its shards), as
    does full_shard with `fp8.gather=false` (the compute-dtype gather, cast after), and the
    rowwise experts differ from the tensorwise ones by more than that."""
    data = batches(3)
    ref, ref_losses = run(moe_build("rowwise", "no_shard", 1), data)
    tensorwise, _ = moe_run("tensorwise", "no_shard", 1, 3)  # the every-strategy test's reference

    def experts(p):
        return [p["segments"][0]["layers"][0]["moe"][k] for k in ("w_gate", "w_up", "w_down")]

    worst, states = 0.0, {}
    for name, strategy, ep, gather in (
        ("on", "full_shard", False, None),
        ("ep", "hybrid_shard", True, None),
        ("off", "full_shard", False, False),
    ):
        state, losses = run(moe_build("rowwise", strategy, 8, ep=ep, gather=gather), data)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, err_msg=name)
        assert tree_max_diff(state.params, ref.params) < 5e-4, name
        worst = max(worst, tree_max_diff(experts(state.params), experts(ref.params)))
        states[name] = state.params
    # f8 gathers on and off: the same e4m3 values and scales (a max is exact); measured equal
    # bit for bit, both 3.7e-9 from one device
    assert tree_max_diff(states["on"], states["off"]) <= 1e-8
    assert tree_max_diff(experts(ref.params), experts(tensorwise.params)) > 10 * worst


def lowered_step(b) -> str:
    """A build's train step (the tiny MoE's on 8 devices), lowered (not compiled): StableHLO text."""
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=b.plan.batch)
    return b.train_step.lower(b.abstract_state, batch).as_text()


def collectives(text: str, op: str, sizes=frozenset({"32", "48", "4"})) -> collections.Counter:
    """(result shape, dtype) of each `op` (all_gather, reduce_scatter) whose result is an
    expert weight of the tiny MoE (8 experts, d_model 32, moe_ffn_dim 48), or a shard of one
    (`sizes`: the other dims' sizes it may have; {"1", "32"}: the rowwise scales)."""
    out = collections.Counter()
    for t in re.findall(rf'stablehlo\.{op}".*?-> tensor<([^>]*)>', text, re.S):  # the op's result type
        *dims, dtype = t.split("x")
        if len(dims) == 3 and dims[0] == "8" and set(dims[1:]) <= sizes:
            out[(int(dims[1]), int(dims[2]), dtype)] += 1
    return out


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_full_shard_gathers_expert_weights_in_f8_and_scatters_f32_grads(recipe):
    """fp8.gather (the default) under full_shard: the step all-gathers each expert weight's
    shards as e4m3 (w_gate, w_up (8, 32, 48) from (8, 4, 48); w_down (8, 48, 32)) inside the MoE
    layer's shard_map, forward and backward, and reduce-scatters their gradients to the shards in
    f32 (the reduce dtype), none in f8; with fp8.gather=false the step has neither (the
    partitioner gathers the compute-dtype weight). Rowwise gathers the scales beside the data
    where the gathered dim is not the one a GEMM's cast contracts: w_down's per-column scales
    (8, 1, 32) forward, w_gate's and w_up's per-row scales (8, 32, 1) backward."""
    on = lowered_step(moe_build(recipe, "full_shard", 8))  # the builds the parity tests run
    gathers, scatters = collectives(on, "all_gather"), collectives(on, "reduce_scatter")
    assert {(32, 48, "f8E4M3FN"): 4, (48, 32, "f8E4M3FN"): 2} == gathers, gathers
    assert {(4, 48, "f32"): 2, (48, 4, "f32"): 1} == scatters, scatters
    scales = collectives(on, "all_gather", {"1", "32"})
    assert scales == ({(1, 32, "f32"): 1, (32, 1, "f32"): 2} if recipe == "rowwise" else {}), scales
    off = lowered_step(moe_build(recipe, "full_shard", 8, gather=False))
    assert not collectives(off, "all_gather") and not collectives(off, "reduce_scatter")


def test_fp8_gather_true_with_rowwise_applies_to_routed_experts_only():
    """`fp8.gather: true` with the rowwise recipe: accepted for a model with routed experts
    (their shards are cast and gathered in f8), refused in one line for a dense model."""
    cfg = moe_cfg("rowwise")
    cfg = dataclasses.replace(cfg, fp8=dataclasses.replace(cfg.fp8, gather=True))
    check_fp8_gather(cfg)
    dense = dataclasses.replace(cfg, model=dataclasses.replace(MOE, n_experts=0))
    with pytest.raises(ConfigError, match="rowwise and no routed experts"):
        check_fp8_gather(dense)


@pytest.mark.slow
def test_gpt_oss_clamped_experts_keep_delayed_histories_and_equal_one_device():
    """gpt-oss's clamped MoE (the tiny golden's config, 2 layers: one sliding, one full; fused
    `w_gate_up`, biases; `swiglu_limit` 0.2 so that the clamp binds: the golden's 1.0 never does
    at this size) under the delayed recipe, f32 compute, 2 SGD steps: the per-expert histories
    of `w_gate_up` and `w_down` are written every step (weights: every expert); full_shard on 8
    devices equals one device in losses, params and the input / weight histories within the
    delayed MoE test's bounds; and the clamp moved the params by more than 3 times the layouts' distance.
    The output-gradient rows of the histories differ between the two runs (up to 1e-3 after step
    1, 43% after step 2, measured 2026-12-07) because their inputs do, not their steps: step 2
    run in both layouts from the same state (one device's after step 1) writes the same rows
    (measured within 1.4e-7). The gap comes from f32 rounding (summation order) flipping e5m2
    casts of the gradient, 2 mantissa bits, whose amaxes the delayed recipe then keeps
    (docs/fp8.md "Why the gradient histories part")."""

    def cfg(limit):
        oss = dataclasses.replace(hf.HFCheckpoint(GOLDEN / "gpt_oss").config, n_layers=2, swiglu_limit=limit)
        return dataclasses.replace(moe_cfg("delayed"), model=oss)

    def hists(state):
        flat = jax.tree_util.tree_flatten_with_path(state.model_state)[0]
        return {jax.tree_util.keystr(p): np.asarray(x) for p, x in flat if "moe" in jax.tree_util.keystr(p)}

    c = cfg(0.2)
    data = [b % c.model.vocab_size for b in batches(2)]
    b1 = built(c, "no_shard", 1)
    ref, ref_losses = run(b1, data)
    names = [k.rsplit("[", 1)[-1].strip("'[]") for k in hists(ref)]
    assert sorted(set(names)) == ["fp8_w_down_amax_from_grad", "fp8_w_gate_up_amax_from_grad"], names
    for h in hists(ref).values():  # (..., E, 3, L): 2 steps pushed, the rest still empty
        assert h.shape[-3:] == (c.model.n_experts, 3, 4) and h[..., 1, :2].all() and not h[..., 2:].any()
        assert h[..., 0, :2].any() and h[..., 2, :2].any()
    b8 = built(c, "full_shard", 8)
    state, losses = run(b8, data)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-4)
    worst = tree_max_diff(state.params, ref.params)
    assert worst < 5e-4
    for k, h in hists(state).items():  # input and weight rows (gradient rows: below)
        np.testing.assert_allclose(h[..., :2, :], hists(ref)[k][..., :2, :], rtol=1e-2, err_msg=k)
    # step 2 from the same state in both layouts: the same histories, gradient rows included
    one, _ = b1.train_step(b1.init_state(jax.random.key(0)), data[0])
    same = jax.device_put(jax.device_get(one), jax.tree.map(lambda a: a.sharding, b8.abstract_state))
    (one, _), (eight, _) = b1.train_step(one, data[1]), b8.train_step(same, data[1])
    for k, h in hists(jax.device_get(eight)).items():
        np.testing.assert_allclose(h, hists(jax.device_get(one))[k], rtol=1e-5, err_msg=k)
    unclamped, _ = run(built(cfg(1e4), "no_shard", 1), data)
    assert tree_max_diff(unclamped.params, ref.params) > 3 * worst  # measured 2.3e-3 against 3.7e-4
