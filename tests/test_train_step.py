"""The FSDP train step: parity with a single device for every strategy, gradient
accumulation, clipping, optimizer-state shardings, bad input."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_jax as fj
from fsdp_jax.train.step_parts import clip_grads, guarded_update, microbatched
from fsdp_jax.train.trainable import Trainable
from helpers import max_abs_diff, reference_train, tiny_llama, token_batches

STRATEGY_MESH = {
    "full_shard": dict(fsdp=8),
    "shard_grad_op": dict(fsdp=8),
    "shard_opt": dict(fsdp=8),
    "no_shard": dict(fsdp=8),
    "hybrid_shard": dict(data=2, fsdp=4),
}


def run_fsdp(strategy, optimizer, batches, mesh_kw=None, grad_norms=None, init_specs=None, **step_kw):
    """(state, plan, losses) after a step per batch; each step's grad norm goes to `grad_norms`, the
    initial state's sharding specs to `init_specs` (a dict: key "state")."""
    m, loss_fn = tiny_llama()
    mesh = fj.make_mesh(**(mesh_kw or STRATEGY_MESH[strategy]))
    state, plan = fj.init_train_state(m.init, optimizer, mesh, jax.random.key(0), strategy, logical_axes=m.logical_axes)
    if init_specs is not None:
        init_specs["state"] = jax.tree.map(lambda x: x.sharding.spec, state)
    step = fj.make_train_step(loss_fn, optimizer, plan, **step_kw)
    losses = []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
        if grad_norms is not None:
            grad_norms.append(float(metrics["grad_norm"]))
    return state, plan, losses


@pytest.fixture(scope="module")
def batches():
    return token_batches(5)


class _Reference(dict):
    """One-device runs, each computed when a test first asks for it (the fast subset asks for
    adamw only)."""

    def __init__(self, batches):
        super().__init__()
        self.batches = batches

    def __missing__(self, name):
        m, loss_fn = tiny_llama()
        p0 = jax.jit(m.init)(jax.random.key(0))
        if name == "grad_norm_0":
            value = float(jax.jit(lambda p, b: optax.tree.norm(jax.grad(loss_fn)(p, b)))(p0, self.batches[0]))
        else:
            opt = {"sgd": optax.sgd(0.5, momentum=0.9), "adamw": optax.adamw(1e-3)}[name]
            value = reference_train(loss_fn, opt, p0, self.batches)
        self[name] = value
        return value


@pytest.fixture(scope="module")
def reference(batches):
    return _Reference(batches)


@pytest.fixture(scope="module")
def trained(batches):
    """run_fsdp on the module's batches, memoised per (strategy, optimizer): one compiled step
    serves every test that trains that program (the parity tests and bf16's fp32 side)."""
    runs = {}
    optimizers = {"sgd_momentum": lambda: optax.sgd(0.5, momentum=0.9), "adamw": lambda: optax.adamw(1e-3)}

    def get(strategy, opt, init_specs=False):
        if (strategy, opt) not in runs:
            norms, specs = [], {}
            state, _, losses = run_fsdp(strategy, optimizers[opt](), batches, grad_norms=norms, init_specs=specs)
            runs[strategy, opt] = state, losses, norms, specs["state"]
        return runs[strategy, opt] if init_specs else runs[strategy, opt][:3]

    return get


# full_shard in the fast subset; the other strategies with the whole suite
ALL_STRATEGIES = [s if s == "full_shard" else pytest.param(s, marks=pytest.mark.slow) for s in STRATEGY_MESH]


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
@pytest.mark.slow
def test_parity_sgd_momentum(strategy, batches, reference, trained):
    state, losses, norms = trained(strategy, "sgd_momentum")
    ref_params, ref_losses = reference["sgd"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_abs_diff(state.params, ref_params) < 1e-6
    assert losses[-1] < losses[0]  # it trains
    assert int(state.step) == len(batches)
    # the reported grad norm is global (over every shard), not this device's slice's
    np.testing.assert_allclose(norms[0], reference["grad_norm_0"], rtol=1e-5)


@pytest.mark.parametrize("strategy", ALL_STRATEGIES)
def test_parity_adamw(strategy, reference, trained):
    state, losses, _ = trained(strategy, "adamw")
    ref_params, ref_losses = reference["adamw"]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_abs_diff(state.params, ref_params) < 1e-4


@pytest.mark.slow
def test_state_layouts_follow_the_strategy(trained):
    """The initial states of test_parity_adamw's runs (adamw: the moments follow the params)."""
    spec = {}
    for s in STRATEGY_MESH:
        state = trained(s, "adamw", init_specs=True)[3]  # the specs of init_train_state's state
        spec[s] = (
            state.params["blocks"]["mlp"]["w_up"],
            state.opt_state[0].mu["blocks"]["mlp"]["w_up"],
            state.opt_state[0].count,
        )
    assert spec["full_shard"] == (P(None, "fsdp", None), P(None, "fsdp", None), P())
    assert spec["shard_grad_op"] == spec["full_shard"]
    assert spec["shard_opt"] == (P(None, None, None), P(None, "fsdp", None), P())
    assert spec["no_shard"] == (P(None, None, None), P(None, None, None), P())
    assert spec["hybrid_shard"] == (P(None, "fsdp", None), P(None, "fsdp", None), P())


def test_full_shard_spans_data_and_fsdp():
    m, _ = tiny_llama()
    state, _ = fj.init_train_state(
        m.init,
        optax.sgd(0.1),
        fj.make_mesh(data=2, fsdp=4),
        jax.random.key(0),
        "full_shard",
        logical_axes=m.logical_axes,
    )
    assert state.params["head"].sharding.spec == P(("data", "fsdp"), None)


@pytest.mark.slow
def test_grad_accumulation_equals_full_batch(batches, trained):
    """Two microbatches of 8 rows (one per device) train like the whole batch of 16: the
    full-batch side is the run test_parity_sgd_momentum checks."""
    s1, l1, _ = trained("full_shard", "sgd_momentum")
    s2, plan, l2 = run_fsdp("full_shard", optax.sgd(0.5, momentum=0.9), batches, microbatches=2)
    np.testing.assert_allclose(l2, l1, rtol=1e-6)
    assert max_abs_diff(s2.params, s1.params) < 1e-6


@pytest.mark.slow
def test_grad_accumulator_lives_in_grad_sharding():
    """Under ZeRO-3 the microbatch loop carries sharded grad accumulators, never a
    full-size copy of the stacked layer weights."""
    opt = optax.sgd(0.5)
    m, loss_fn = tiny_llama()
    state, plan = fj.init_train_state(
        m.init, opt, fj.make_mesh(fsdp=8), jax.random.key(0), "full_shard", logical_axes=m.logical_axes
    )
    step = fj.make_train_step(loss_fn, opt, plan, microbatches=4)
    hlo = step.lower(state, token_batches(1, batch=32)[0]).compile().as_text()
    # the microbatch loop is the one whose state holds the (4, 32/4/8, 33) token slices
    loops = [l.split(" while(")[0] for l in hlo.splitlines() if " while(" in l and "s32[4,1,33]" in l]
    assert len(loops) == 1
    state_types = loops[0]
    assert "f32[256,8]" in state_types and "f32[8,256]" in state_types  # embed/head grads, 1/8 each
    assert "f32[2,8,128]" in state_types  # stacked w_up grads: embed dim 64 / 8
    for full in ("f32[2,64,128]", "f32[2,128,64]", "f32[2,64,4,16]"):
        assert full not in state_types


@pytest.mark.slow
def test_clipping_matches_single_device(batches, trained):
    m, loss_fn = tiny_llama()
    opt = optax.sgd(0.5, momentum=0.9)
    p0 = jax.jit(m.init)(jax.random.key(0))
    ref_params, ref_losses = reference_train(loss_fn, opt, p0, batches, clip_norm=0.05)
    state, plan, losses = run_fsdp("full_shard", opt, batches, clip_norm=0.05)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_abs_diff(state.params, ref_params) < 1e-6
    unclipped, _, _ = trained("full_shard", "sgd_momentum")  # the same run without clipping
    assert max_abs_diff(unclipped.params, state.params) > 1e-4  # clipping really acted


@pytest.mark.slow
def test_nonfinite_step_is_skipped(batches):
    m, loss_fn = tiny_llama()
    opt = optax.adamw(1e-2)
    state, plan = fj.init_train_state(m.init, opt, fj.make_mesh(fsdp=8), jax.random.key(0), logical_axes=m.logical_axes)

    def nan_loss(params, tokens):
        return loss_fn(params, tokens) * jnp.where(tokens[0, 0] == 7, jnp.nan, 1.0)

    step = fj.make_train_step(nan_loss, opt, plan, donate=False)
    bad = batches[0].at[0, 0].set(7)
    new, metrics = step(state, bad)
    assert int(metrics["skipped"]) == 1 and not np.isfinite(float(metrics["loss"]))
    assert max_abs_diff(new.params, state.params) == 0.0 and int(new.step) == 0
    good = batches[0].at[0, 0].set(3)
    new, metrics = step(state, good)
    assert int(metrics["skipped"]) == 0 and int(new.step) == 1


def test_optimizer_state_shardings_for_any_optax_transform():
    mesh = fj.make_mesh(fsdp=8)
    params = {
        "w": jax.ShapeDtypeStruct((256, 512), jnp.float32),
        "frozen": jax.ShapeDtypeStruct((512, 64), jnp.float32),
        "b": jax.ShapeDtypeStruct((512,), jnp.float32),
    }
    axes_ = {"w": ("embed", "mlp"), "frozen": ("mlp", "embed"), "b": ("mlp",)}
    for opt in [
        optax.sgd(0.1, momentum=0.9),
        optax.adafactor(1e-3),
        optax.chain(
            optax.clip_by_global_norm(1.0), optax.masked(optax.adam(1e-3), {"w": True, "frozen": False, "b": True})
        ),
    ]:
        plan = fj.make_plan(params, opt, mesh, "full_shard", axes_)
        st = jax.eval_shape(opt.init, params)
        for x, sh in zip(jax.tree.leaves(st), jax.tree.leaves(plan.opt_state)):
            shard = sh.shard_shape(x.shape)  # raises if the spec does not fit the leaf
            if x.ndim == 0:
                assert sh.spec == P()
            elif x.shape == (256, 512):
                assert shard == (32, 512)
            elif np.prod(x.shape) >= 2**14:
                assert np.prod(shard) * 8 == np.prod(x.shape)


def test_bad_batch_is_a_clear_error():
    m, loss_fn = tiny_llama()
    opt = optax.sgd(0.1)
    state, plan = fj.init_train_state(m.init, opt, fj.make_mesh(fsdp=8), jax.random.key(0), logical_axes=m.logical_axes)
    step = fj.make_train_step(loss_fn, opt, plan, microbatches=2)
    with pytest.raises(
        fj.BatchError,
        match=r"leading dim 12, which must be divisible by "
        r"microbatches \(2\) x data x fsdp \(8\) = 16",
    ):
        step(state, token_batches(1, batch=12)[0])


def test_plain_dict_model_trains_with_fallback_rule():
    def init(rng):
        k1, k2 = jax.random.split(rng)
        return {
            "w1": jax.random.normal(k1, (64, 512)) * 0.05,
            "w2": jax.random.normal(k2, (512, 64)) * 0.05,
            "bias": jnp.zeros((64,)),
        }

    def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((jnp.tanh(x @ p["w1"]) @ p["w2"] + p["bias"] - y) ** 2)

    opt = optax.sgd(0.1, momentum=0.9)
    state, plan = fj.init_train_state(init, opt, fj.make_mesh(fsdp=8), jax.random.key(0))
    reasons = {r.path: r.reason for r in plan.rows}
    assert reasons["w1"].startswith("fallback: dim 1") and reasons["bias"].startswith("threshold")
    assert state.params["w2"].sharding.spec == P("fsdp", None)
    x = jax.random.normal(jax.random.key(1), (32, 64))
    batch = (x, jnp.sin(x))
    step = fj.make_train_step(loss_fn, opt, plan)
    ref_params, ref_losses = reference_train(loss_fn, opt, jax.jit(init)(jax.random.key(0)), [batch] * 5)
    losses = []
    for _ in range(5):
        state, m = step(state, batch)
        losses.append(float(m["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_abs_diff(state.params, ref_params) < 1e-6 and losses[-1] < losses[0]


@pytest.mark.slow
def test_bf16_compute_trains_close_to_fp32(batches, trained):
    _, l32, _ = trained("full_shard", "sgd_momentum")  # the fp32 run test_parity_sgd_momentum checks
    s16, _, l16 = run_fsdp(
        "full_shard", optax.sgd(0.5, momentum=0.9), batches, precision="params=float32,compute=bfloat16"
    )
    assert jax.tree.leaves(s16.params)[0].dtype == jnp.float32  # master weights stay fp32
    np.testing.assert_allclose(l16, l32, rtol=2e-2)


@pytest.mark.slow
def test_bf16_params_store_master_weights_and_adam_moments_in_bf16(batches):
    """precision params=bfloat16: the state (params and Adam's moments, which follow
    the params) is bf16 before and after steps, holding half the bytes of fp32."""
    from fsdp_jax.hlo.memory import tree_bytes_per_device

    m, loss_fn = tiny_llama()
    opt, mesh = optax.adamw(1e-3), fj.make_mesh(fsdp=8)
    b16 = fj.build(m, opt, mesh, loss_fn=loss_fn, precision="params=bfloat16,compute=bfloat16")
    b32 = fj.build(m, opt, mesh, precision="params=float32,compute=bfloat16")  # its state only
    moments = lambda st: [x for x in jax.tree.leaves(st.opt_state) if x.ndim]  # noqa: E731
    for built, dtype in ((b16, jnp.bfloat16), (b32, jnp.float32)):
        assert {x.dtype for x in jax.tree.leaves(built.abstract_state.params)} == {jnp.dtype(dtype)}
        assert {x.dtype for x in moments(built.abstract_state)} == {jnp.dtype(dtype)}
    for part in (lambda st: st.params, moments):
        assert (
            2 * tree_bytes_per_device(part(b16.abstract_state)) == tree_bytes_per_device(part(b32.abstract_state)) > 0
        )
    state = b16.init_state(jax.random.key(0))
    l16 = []
    for b in batches[:3]:
        state, metrics = b16.train_step(state, b)
        l16.append(float(metrics["loss"]))
    assert {x.dtype for x in jax.tree.leaves(state.params) + moments(state)} == {jnp.dtype(jnp.bfloat16)}
    assert tree_bytes_per_device(state.params) == tree_bytes_per_device(b16.abstract_state.params)
    assert l16[-1] < l16[0]


# -- the step's parts, each on its own -------------------------------------------------------


def _mlp_loss(p, batch, out_sharding=None):
    x, y = batch
    kw = {} if out_sharding is None else {"out_sharding": out_sharding}
    h = jnp.tanh(jnp.dot(x, p["w1"], **kw))
    return jnp.mean((jnp.dot(h, p["w2"], **kw) - y) ** 2), jnp.mean(h)


def _mlp(rng=0):
    k1, k2, k3 = jax.random.split(jax.random.key(rng), 3)
    p = {"w1": jax.random.normal(k1, (64, 256)) * 0.05, "w2": jax.random.normal(k2, (256, 64)) * 0.05}
    x = jax.random.normal(k3, (32, 64))
    return p, (x, jnp.sin(x))


@pytest.mark.parametrize("k", [2, 4])
def test_microbatched_averages_loss_and_grads_and_stacks_aux(k):
    p, batch = _mlp()

    def grad_fn(params, b):
        (loss, aux), g = jax.value_and_grad(_mlp_loss, has_aux=True)(params, b)
        return loss, aux, g

    loss1, _, g1 = jax.jit(grad_fn)(p, batch)
    loss_k, aux_k, g_k = jax.jit(microbatched(grad_fn, k))(p, batch)
    np.testing.assert_allclose(float(loss_k), float(loss1), rtol=1e-6)
    assert max_abs_diff(g_k, g1) < 1e-7 and aux_k.shape == (k,)
    # slice j is rows j, j+k, ...: its aux is the model's on exactly those rows
    np.testing.assert_allclose(
        float(aux_k[1]), float(_mlp_loss(p, jax.tree.map(lambda x: x[1::k], batch))[1]), rtol=1e-6
    )
    assert microbatched(grad_fn, 1) is grad_fn
    with pytest.raises(ValueError, match="microbatches must be >= 1"):
        microbatched(grad_fn, 0)


def test_trainable_differentiates_only_trainable_leaves():
    p, batch = _mlp()
    mesh = fj.make_mesh(fsdp=8)
    sh = {"w1": jax.NamedSharding(mesh, P("fsdp", None)), "w2": jax.NamedSharding(mesh, P(None, "fsdp"))}
    wrt = Trainable(p, {"w1": False, "w2": True})
    assert wrt.keep == [False, True] and len(wrt.select(p)) == 1
    g = jax.grad(lambda x: _mlp_loss(wrt.join(x), batch)[0])(wrt.select(p))
    full = jax.jit(lambda g: wrt.full_grads(g, sh))(g)
    ref = jax.grad(lambda q: _mlp_loss(q, batch)[0])(p)
    assert float(jnp.max(jnp.abs(full["w1"]))) == 0.0 and full["w1"].sharding.is_equivalent_to(sh["w1"], 2)
    assert max_abs_diff(full["w2"], ref["w2"]) < 1e-7
    everything = Trainable(p, None)
    assert everything.select(p) is p and everything.full_grads(ref, sh) is ref


def test_clip_grads_scales_to_the_global_norm():
    g = {"a": jnp.full((4,), 3.0), "b": jnp.full((9,), 4.0)}  # norm sqrt(36 + 144)
    norm = np.sqrt(4 * 9 + 9 * 16)
    clipped, n = clip_grads(g, 1.0)
    assert float(n) == pytest.approx(norm) and float(optax.tree.norm(clipped)) == pytest.approx(1.0)
    same, n = clip_grads(g, None)
    assert same is g and float(n) == pytest.approx(norm)
    same, _ = clip_grads(g, 100.0)
    assert max_abs_diff(same, g) == 0.0


@pytest.mark.parametrize("skip", [True, False])
def test_guarded_update_applies_only_finite_steps(skip):
    opt = optax.sgd(0.1)
    p = {"w": jnp.ones((4,))}
    st = fj.TrainState(step=jnp.zeros((), jnp.int32), params=p, opt_state=opt.init(p))
    g = {"w": jnp.full((4,), 2.0)}
    upd = jax.jit(lambda s, g, ok: guarded_update(opt, s, g, ok, skip))
    new = upd(st, g, jnp.bool_(True))
    assert int(new.step) == 1 and float(new.params["w"][0]) == pytest.approx(0.8)
    new = upd(st, g, jnp.bool_(False))
    if skip:
        assert int(new.step) == 0 and max_abs_diff(new.params, p) == 0.0
    else:
        assert int(new.step) == 1 and float(new.params["w"][0]) == pytest.approx(0.8)


@pytest.fixture(scope="module")
def mlp_reference():
    """One device's 3 SGD+momentum steps of `_mlp` on its batch: every explicit-axes case's reference."""
    p, batch = _mlp()
    return reference_train(lambda q, b: _mlp_loss(q, b)[0], optax.sgd(0.5, momentum=0.9), p, [batch] * 3)


@pytest.mark.parametrize(
    "strategy, mesh_kw, micro",
    [
        ("full_shard", dict(fsdp=8), 2),
        ("shard_grad_op", dict(fsdp=8), 1),
        pytest.param("hybrid_shard", dict(data=2, fsdp=4), 1, marks=pytest.mark.slow),
        pytest.param("full_shard", dict(fsdp=4, tensor=2), 1, marks=pytest.mark.slow),
    ],
)
def test_explicit_axes_model_with_out_sharding_trains_like_one_device(strategy, mesh_kw, micro, mlp_reference):
    """A model written for JAX's explicit sharding mode (`out_sharding=` on its matmuls)
    trains on an Explicit mesh with every strategy, as a single device does; on the
    default Auto mesh such a model is rejected by JAX itself."""
    p, batch = _mlp()
    axes_ = {"w1": ("embed", "mlp"), "w2": ("mlp", "embed")}
    act = fj.logical_to_spec(("batch", None))  # P(("data", "fsdp"), None)

    def loss_fn(params, b):
        return _mlp_loss(params, b, out_sharding=act)[0]

    model = fj.ModelFns(
        init=lambda rng: _mlp()[0], apply=None, logical_axes=axes_, abstract_params=jax.eval_shape(lambda: p)
    )
    opt = optax.sgd(0.5, momentum=0.9)  # SGD: parity to rounding (AdamW amplifies it, docs/design.md)
    mesh = fj.make_mesh(**mesh_kw, axis_types="explicit")
    built = fj.build(model, opt, mesh, strategy, loss_fn=loss_fn, microbatches=micro)
    state = built.init_state(jax.random.key(0))
    assert state.params["w1"].sharding.spec == built.plan.params["w1"].spec
    losses = []
    for _ in range(3):
        state, metrics = built.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    ref_params, ref_losses = mlp_reference  # the same optimizer, params and batches
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_abs_diff(state.params, ref_params) < 1e-6 and losses[-1] < losses[0]
    if strategy == "full_shard" and micro == 2:
        with pytest.raises(ValueError, match="Auto"):
            auto = fj.build(model, opt, fj.make_mesh(**mesh_kw), strategy, loss_fn=loss_fn)
            auto.train_step(auto.init_state(jax.random.key(0)), batch)
