"""FP8 matmuls (`fsdp_jax.quant.fp8`, docs/fp8.md): the scaled matmul against its formula,
e5m2 gradients, the delayed recipe's amax histories, every strategy against one device,
resume of the histories, and bad input."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx

from fsdp_jax.app.config.schema import Config, Fp8Config
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.planner.op_costs import op_seconds
from fsdp_jax.app.trainer.build import build_from_config, fp8_recipe, trainer_model
from fsdp_jax.checkpoint import Checkpointer
from fsdp_jax.model import from_nnx
from fsdp_jax.quant import fp8
from fsdp_jax.quant.fp8_modules import attach, meta_name, project
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.targets.perf_tables import perf_table
from fsdp_jax.train.shard_model import shard_model
from fsdp_jax.verify.compare import strategy_mesh_shape
from helpers import TINY_RUN_OVERRIDES, call, one_line

STRATEGIES = ("full_shard", "shard_grad_op", "shard_opt", "no_shard", "hybrid_shard")
TINY = DecoderConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=16)


@functools.partial(jax.jit, static_argnames=("seed", "n", "k", "m", "dtype"))
def operands(seed=0, n=32, k=64, m=48, dtype=jnp.bfloat16):
    """(x, w): one compile per shape, not one per op of an eager draw."""
    kx, kw = jax.random.split(jax.random.key(seed))
    x = (jax.random.normal(kx, (n, k)) * 3.0).astype(dtype)
    w = (jax.random.normal(kw, (k, m)) * 0.02).astype(dtype)
    return x, w


@jax.jit
def _dot_highest(a, b):
    return jnp.dot(a, b, precision="highest")


def f32dot(a, b):
    """The f32 GEMM of the references: XLA's dot (its accumulation order, the library's), one
    compile per shape (as the eager op's)."""
    return np.asarray(_dot_highest(a, b), np.float32)


def bf16(a):
    """`a` rounded to bfloat16 (ml_dtypes: round to nearest even, as XLA's convert), as f32."""
    return np.asarray(a, np.float32).astype(ml_dtypes.bfloat16).astype(np.float32)


def primal_and_vjp(f, *args):
    """(f(*args), f's vjp at `args`) from one compile with XLA's excess precision off (XLA may skip
    an intermediate rounding, the GEMM's bf16 output, unless told not to): not an eager forward for
    the vjp, each of its ops a compile of its own."""
    both = jax.jit(lambda *a: (f(*a), jax.vjp(f, *a)[1]))
    return both.lower(*args).compile({"xla_allow_excess_precision": False})(*args)


def np_quantize(x, scale, dtype):
    """The cast, written with numpy and ml_dtypes (round to nearest even, saturated)."""
    m = float(ml_dtypes.finfo(dtype).max)
    return np.clip(np.asarray(x, np.float32) * np.float32(scale), -m, m).astype(dtype)


# ----------------------------------------------------------------------------- numerics


def test_scaled_matmul_equals_its_reference_formula():
    """cast (x * 448 / amax to e4m3, saturating), f32 accumulation written in bf16, unscale:
    bit for bit."""
    x, w = operands()
    ax, aw = np.abs(np.asarray(x, np.float32)).max(), np.abs(np.asarray(w, np.float32)).max()
    sx, sw = np.float32(448.0) / ax, np.float32(448.0) / aw

    def f(x, w):
        return fp8.scaled_matmul(x, w, fp8.scale_for(fp8.amax(x), fp8.E4M3), fp8.scale_for(fp8.amax(w), fp8.E4M3))

    # XLA may skip an intermediate rounding (here the GEMM's bf16 output) unless told not to
    got = jax.jit(f).lower(x, w).compile({"xla_allow_excess_precision": False})(x, w)
    xq, wq = np_quantize(x, sx, ml_dtypes.float8_e4m3fn), np_quantize(w, sw, ml_dtypes.float8_e4m3fn)
    # the f32 dot of the f8 values, written in bf16, then unscaled in f32 and rounded to bf16
    want = bf16(bf16(f32dot(xq.astype(np.float32), wq.astype(np.float32))) * (np.float32(1.0) / (sx * sw)))
    assert got.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(got, np.float32), want)
    # and it is an FP8 matmul, not the bf16 one: the rounding shows
    exact = np.asarray(x, np.float32) @ np.asarray(w, np.float32)
    assert 1e-3 < np.abs(np.asarray(got, np.float32) - exact).max() / np.abs(exact).max() < 0.1


def test_saturating_cast_never_makes_inf_or_nan():
    big = jnp.asarray([1e6, -1e6, 3.0], jnp.float32)
    q = fp8.quantize(big, jnp.float32(1.0), fp8.E4M3)
    np.testing.assert_array_equal(np.asarray(q, np.float32), [448.0, -448.0, 3.0])
    assert float(fp8.scale_for(jnp.float32(0.0), fp8.E4M3)) == 1.0
    assert float(fp8.scale_for(jnp.float32(jnp.inf), fp8.E4M3)) == 1.0


@jax.jit
def _grad_and_scales(x, w):
    """An output gradient for `x @ w` and the e4m3 scales of x and w: one program, not op by op."""
    g = (jax.random.normal(jax.random.key(7), (x.shape[0], w.shape[1])) * 1e-3).astype(jnp.bfloat16)
    return g, fp8.scale_for(fp8.amax(x), fp8.E4M3), fp8.scale_for(fp8.amax(w), fp8.E4M3)


def test_gradients_are_e5m2_scaled_by_their_current_amax():
    """dx and dw come from the output gradient cast to e5m2 (57344 / amax(g)) times the
    saved e4m3 operands, accumulated in f32: equal to that formula, and the backward's
    jaxpr holds e5m2 dots."""
    x, w = operands(1)
    g, sx, sw = _grad_and_scales(x, w)
    _, vjp = primal_and_vjp(lambda x, w: fp8.scaled_matmul(x, w, sx, sw), x, w)
    dx, dw = jax.jit(vjp)(g)
    sg = np.float32(57344.0) / np.abs(np.asarray(g, np.float32)).max()
    gq = np_quantize(g, sg, ml_dtypes.float8_e5m2).astype(np.float32)
    xq = np_quantize(x, sx, ml_dtypes.float8_e4m3fn).astype(np.float32)
    wq = np_quantize(w, sw, ml_dtypes.float8_e4m3fn).astype(np.float32)
    want_dx = bf16(f32dot(gq, wq.T) * (np.float32(1.0) / (sg * np.float32(sw))))
    want_dw = bf16(f32dot(xq.T, gq) * (np.float32(1.0) / (np.float32(sx) * sg)))
    assert dx.dtype == x.dtype == dw.dtype == w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dx, np.float32), want_dx)
    np.testing.assert_array_equal(np.asarray(dw, np.float32), want_dw)
    text = str(jax.make_jaxpr(vjp)(g))
    assert "f8_e5m2" in text and "f8_e4m3fn" in text
    assert "f8_e5m2" not in str(jax.make_jaxpr(lambda x, w: fp8.scaled_matmul(x, w, sx, sw))(x, w))


@pytest.mark.parametrize("history", [(0.0, 0.0, 0.0), (2e-3, 5e-4, 0.0)])
def test_delayed_gradient_scale_comes_from_its_history(history):
    """`grad_history`: g is cast to e5m2 with 57344 / max(history) (its current amax while
    the history is all zeros), dx and dw equal that formula bit for bit, and the history's
    cotangent is the history with amax(g) pushed in front (the step's new history)."""
    x, w = operands(1)
    g, sx, sw = _grad_and_scales(x, w)
    gh = jax.device_put(np.asarray(history, np.float32))
    y, vjp = primal_and_vjp(lambda x, w, h: fp8.scaled_matmul(x, w, sx, sw, grad_history=h), x, w, gh)
    # without the history: compiled alike (no excess precision), one program, not op by op
    plain = jax.jit(fp8.scaled_matmul).lower(x, w, sx, sw).compile({"xla_allow_excess_precision": False})
    np.testing.assert_array_equal(np.asarray(y), np.asarray(plain(x, w, sx, sw)))
    dx, dw, new = jax.jit(vjp)(g)
    ag = np.abs(np.asarray(g, np.float32)).max()
    sg = np.float32(57344.0) / (np.float32(max(history)) if max(history) > 0 else ag)
    gq = np_quantize(g, sg, ml_dtypes.float8_e5m2).astype(np.float32)
    xq = np_quantize(x, sx, ml_dtypes.float8_e4m3fn).astype(np.float32)
    wq = np_quantize(w, sw, ml_dtypes.float8_e4m3fn).astype(np.float32)
    want_dx = bf16(f32dot(gq, wq.T) * (np.float32(1.0) / (sg * np.float32(sw))))
    want_dw = bf16(f32dot(xq.T, gq) * (np.float32(1.0) / (np.float32(sx) * sg)))
    assert dx.dtype == x.dtype == dw.dtype == w.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(dx, np.float32), want_dx)
    np.testing.assert_array_equal(np.asarray(dw, np.float32), want_dw)
    np.testing.assert_array_equal(np.asarray(new), np.asarray([ag, *history[:-1]], np.float32))
    if max(history) > 0:  # the history's scale, not the current one: the e5m2 values differ
        assert not np.array_equal(
            gq, np_quantize(g, np.float32(57344.0) / ag, ml_dtypes.float8_e5m2).astype(np.float32)
        )


class _Proj(nnx.Module):
    def __init__(self, recipe):
        self.w = nnx.Param(operands(2, k=16, m=8)[1].astype(jnp.float32))
        attach(self, recipe, ("w",))

    def __call__(self, x):
        return project(self, "w", x, self.w[...], self.w.shape)


def test_delayed_history_pushes_amaxes_and_scales_by_the_past():
    """Each call pushes (amax x, amax w) in front, drops the oldest; the scale it used is
    448 / max of the history before the call (the current amax while it is all zeros)."""
    m = _Proj(fp8.Fp8Recipe("delayed", amax_history=3))
    hist = getattr(m, meta_name("w"))
    assert hist[...].shape == (2, 3) and not np.asarray(hist[...]).any()
    w_amax = float(np.abs(np.asarray(m.w[...])).max())
    xs = [np.full((4, 16), v, np.float32) for v in (2.0, 8.0, 1.0, 0.5)]
    for i, x in enumerate(xs):
        before = np.asarray(hist[...]).copy()
        y = _call(m, x)
        ref = before[0].max() if before[0].max() > 0 else float(np.abs(x).max())
        want_y = _scaled_by(x, m.w[...], np.float32(ref), np.float32(before[1].max() or w_amax))
        np.testing.assert_array_equal(np.asarray(y), np.asarray(want_y))
        want = [float(np.abs(v).max()) for v in xs[: i + 1]][::-1][:3]
        np.testing.assert_array_equal(np.asarray(hist[...])[0][: len(want)], want)
        np.testing.assert_allclose(np.asarray(hist[...])[1][: len(want)], w_amax)
    # step 3's x (amax 1) was scaled by the history's 8, not its own amax
    assert float(np.max(before[0])) == 8.0


@nnx.jit
def _call(m, x):
    """`m(x)`, its history pushed: one compile for every call of the same shapes, the
    reference's alike (`_scaled_by`), not one per op of an eager call."""
    return m(x)


@jax.jit
def _scaled_by(x, w, ref_x, ref_w):
    """`scaled_matmul` with the scales of the amaxes `ref_x` and `ref_w`."""
    return fp8.scaled_matmul(x, w, fp8.scale_for(ref_x, fp8.E4M3), fp8.scale_for(ref_w, fp8.E4M3))


def test_the_step_keeps_the_gradient_history_its_backward_wrote_per_microbatch():
    """The train step's `*_from_grad` channel (`fsdp_jax.model.variables`): one step of 2
    microbatches leaves the projection's gradient history holding each microbatch's output
    gradient amax, newest first (microbatch j takes rows j, j + 2, ...), computed here by hand."""
    model = from_nnx(lambda rngs: _Proj(fp8.Fp8Recipe("delayed", amax_history=3)))
    mesh = make_mesh(1, 1, devices=jax.devices()[:1])
    sm = shard_model(model, optax.sgd(0.0), mesh, "no_shard", rng=jax.random.key(0), max_replicated_fraction=None)

    def loss_fn(params, batch, *, state, rng, train):
        y, state = model.apply(params, batch["x"], state=state, rng=rng, train=train)
        return jnp.mean((y - batch["t"]) ** 2), state

    kx, kt = jax.random.split(jax.random.key(5))
    batch = {"x": jax.random.normal(kx, (8, 16)) * 2.0, "t": jax.random.normal(kt, (8, 8))}
    state, _ = sm.train_step(loss_fn, microbatches=2)(sm.state, batch)
    got = np.asarray(jax.tree.leaves({k: v for k, v in state.model_state.items() if k.endswith("from_grad")})[0])
    m, want = _Proj(fp8.Fp8Recipe("delayed", amax_history=3)), []
    np.testing.assert_array_equal(np.asarray(state.params["w"]), np.asarray(m.w[...]))  # lr 0: the same weight
    for j in range(2):  # each microbatch's output gradient: d mean((y - t)^2) / dy
        y = np.asarray(_call(m, batch["x"][j::2]))  # jitted, and the formula on the host: not op by op
        want.insert(0, float(np.abs(2.0 * (y - np.asarray(batch["t"][j::2])) / y.size).max()))
    np.testing.assert_array_equal(got, np.asarray([*want, 0.0], np.float32))


def test_tensorwise_keeps_no_state():
    m = _Proj(fp8.Fp8Recipe("tensorwise"))
    assert not jax.tree.leaves(nnx.state(m, nnx.Not(nnx.Param)))


# ----------------------------------------------------------------------------- the trainer's step


def cfg_for(recipe="delayed", compute="float32", history=4):
    return dataclasses.replace(
        Config(),
        model=TINY,
        precision=f"params=float32,compute={compute},matmul=fp8",
        fp8=Fp8Config(recipe=recipe, amax_history=history, emulate=True),
    )


def batches(n, b=8, s=16):
    k = jax.random.key(3)
    return [jax.random.randint(jax.random.fold_in(k, i), (b, s + 1), 0, TINY.vocab_size, jnp.int32) for i in range(n)]


def built(cfg, strategy, n_devices):
    model = trainer_model(cfg.model, "none", None, fp8_recipe(cfg))
    devices = jax.devices()[:n_devices]
    mesh = make_mesh(*strategy_mesh_shape(strategy, n_devices), devices=devices)
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, min_shard_size=64))
    return build_from_config(cfg, model, optax.sgd(0.1), mesh, strategy, max_replicated_fraction=None)


def run(b, steps):
    state = b.init_state(jax.random.key(0))
    losses = []
    for batch in steps:
        state, m = b.train_step(state, batch)
        losses.append(float(m["loss"]))
    return jax.device_get(state), losses


def tree_max_diff(a, b):
    return max(
        float(np.abs(np.asarray(x, np.float64) - np.asarray(y, np.float64)).max())
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


@pytest.mark.slow
def test_every_strategy_equals_one_device():
    """Delayed recipe, f32 compute, 4 SGD steps: the five strategies on 8 devices agree with
    each other (to 1e-6) and with one device: loss (rel 1e-4), params (5e-4), amax
    histories (rel 1e-2). One device runs other dot shapes, whose f32 rounding (1 ulp) can
    flip an element's e4m3 / e5m2 rounding (1 in 8 / 1 in 4): measured under the suite's
    -O0 codegen 1.2e-5, 2.8e-4 and 8e-4, against FP8's own distance from f32 of 5.6e-4 in
    params (without -O0: 1.1e-7, 7e-9, 1.2e-7)."""
    cfg, data = cfg_for(), batches(4)
    ref, ref_losses = run(built(cfg, "no_shard", 1), data)
    assert np.asarray(jax.tree.leaves(ref.model_state)[0])[..., :4].all()  # 4 steps pushed, non-zero
    first = None
    for strategy in STRATEGIES:
        state, losses = run(built(cfg, strategy, 8), data)
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-4, err_msg=strategy)
        assert tree_max_diff(state.params, ref.params) < 5e-4, strategy
        for h, r in zip(jax.tree.leaves(state.model_state), jax.tree.leaves(ref.model_state)):
            np.testing.assert_allclose(h, r, rtol=1e-2, err_msg=strategy)
        first = first or state
        assert tree_max_diff(state, first) < 1e-6, strategy


@pytest.mark.slow
def test_resume_restores_histories_exactly(tmp_path):
    """4 steps straight = 2 steps, a checkpoint, a fresh build restoring it, 2 more:
    params, optimizer state and amax histories (inputs', weights' and output gradients',
    the last written by the backward pass) bit for bit."""
    cfg, data = cfg_for(compute="bfloat16"), batches(4)
    b = built(cfg, "full_shard", 8)
    straight, _ = run(b, data)
    state = b.init_state(jax.random.key(0))
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        for batch in data[:2]:
            state, _ = b.train_step(state, batch)
        ckpt.save(2, state)
    b2 = built(cfg, "full_shard", 8)
    restored = Checkpointer(tmp_path / "ckpt", read_only=True).restore(b2.abstract_state).state
    hists = jax.tree_util.tree_flatten_with_path(jax.device_get(restored.model_state))[0]
    assert sum("grad_amax_from_grad" in jax.tree_util.keystr(p) for p, _ in hists) == 7  # one per projection
    for _, hist in hists:
        assert hist.shape[-1] == 4 and np.asarray(hist)[..., :2].all() and not np.asarray(hist)[..., 2:].any()
    for batch in data[2:]:
        restored, _ = b2.train_step(restored, batch)
    for x, y in zip(jax.tree.leaves(jax.device_get(restored)), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


# ----------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "platform,kind,cc,emulate,ok",
    [
        ("cpu", "cpu", None, False, False),
        ("cpu", "cpu", None, True, True),
        ("gpu", "NVIDIA A100-SXM4-80GB", "8.0", False, False),
        ("gpu", "NVIDIA H100 80GB HBM3", "9.0", False, True),
        ("gpu", "h200", None, False, True),
        ("gpu", "a100", None, True, False),  # emulation is for CPU only
        ("tpu", "TPU v5p", None, False, False),
        ("tpu", "TPU v4", None, True, False),
    ],
)
def test_devices_without_fp8_units_are_refused(platform, kind, cc, emulate, ok):
    problem = fp8.device_problem(platform, kind, cc, emulate)
    assert (problem is None) == ok
    if problem:
        assert "\n" not in problem and ("emulate" in problem or "FP8" in problem)


def test_bad_recipe_and_history_are_one_line():
    with pytest.raises(ValueError, match="unknown fp8 recipe 'mxfp8'"):
        fp8.Fp8Recipe("mxfp8")
    with pytest.raises(ValueError, match="amax_history must be an integer >= 1"):
        fp8.Fp8Recipe("delayed", amax_history=0)


FP8 = "precision=params=float32,compute=bfloat16,matmul=fp8"


@pytest.mark.parametrize(
    "overrides,words",
    [
        ([FP8], ("precision", "fp8.emulate=true")),  # CPU without emulation
        ([FP8, "fp8.emulate=true", "fp8.recipe=hybrid"], ("fp8.recipe", "tensorwise, delayed")),
        ([FP8, "fp8.emulate=true", "fp8.amax_history=0"], ("fp8.amax_history", "> 0")),
        ([FP8, "fp8.emulate=true", "lora.rank=4"], ("lora.rank", "matmul=fp8")),
        # fp8.gather asked for where weights are not gathered per layer, or cast after the gather
        ([FP8, "fp8.emulate=true", "fp8.gather=true", "mesh.strategy=ddp"], ("fp8.gather", "full_shard")),
        ([FP8, "fp8.emulate=true", "fp8.gather=true", "fp8.recipe=rowwise"], ("fp8.gather", "rowwise")),
        (["precision=params=float32,matmul=fp4"], ("precision", "fp8, compute")),
    ],
)
def test_bad_fp8_input_is_one_line_exit_2(corpus, tmp_path, capsys, overrides, words):
    run_dir = tmp_path / "run"
    args = [f"{o}" for o in TINY_RUN_OVERRIDES + [f"data.path={corpus}", f"run_dir={run_dir}", *overrides]]
    rc, _, err = call("train", "--config", "configs/tiny.yaml", "--no-progress", *args, capsys=capsys)
    one_line(rc, err, *words)
    assert not run_dir.exists()


# ----------------------------------------------------------------------------- the step-time model


@pytest.mark.parametrize("target", ["h100", "h200"])
def test_fp8_gemms_cost_at_the_fp8_peak(target):
    """A compute-bound GEMM record with e4m3 or e5m2 operands (forward, backward) takes the
    bf16 GEMM model at the FP8 peak (twice bf16's on Hopper): half the compute time."""
    t = perf_table(target)
    m = n = k = 8192
    launch = t["hbm"]["launch_s"]
    base = {"kind": "gemm", "m": m, "n": n, "k": k, "batch": 1, "flops": 2 * m * n * k, "bytes": 3 * m * n}
    bf16 = op_seconds({**base, "dtype": "bf16"}, t) - launch
    peaks = t["peak_flops"]
    assert peaks["f8e5m2"] == peaks["f8e4m3fn"] > 1.99 * peaks["bf16"]  # 1979 vs 989 TFLOP/s
    for dtype in ("f8e4m3fn", "f8e5m2"):
        want = bf16 * peaks["bf16"] / peaks[dtype]
        assert op_seconds({**base, "dtype": dtype}, t) - launch == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("target,words", [("a100", "no FP8 tensor cores"), ("v5p", "no FP8 matmul units")])
def test_planning_fp8_for_a_target_without_fp8_units_is_one_line_exit_2(target, words, capsys):
    args = ["--config", "configs/tiny.yaml", "--target", target, "--devices", "8", FP8]
    rc, _, err = call("plan", *args, capsys=capsys)
    one_line(rc, err, "precision", words)
