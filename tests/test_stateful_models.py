"""Models with non-trainable state and randomness (`fsdp_jax.model.variables`): Flax's own
ImageNet ResNet (Linen, BatchNorm; tests/third_party/flax_resnet.py, unchanged) and an
NNX network with BatchNorm + Dropout, through shard_model, build, verify, explain,
the planner's bytes and checkpoints; bad input, one line each."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx, struct
from third_party.flax_resnet import ResNet, ResNetBlock

import fsdp_jax as fj
from fsdp_jax.app.exits import BAD_INPUT
from fsdp_jax.checkpoint import Checkpointer
from fsdp_jax.errors import StateError
from fsdp_jax.hlo.memory import state_bytes_per_device
from fsdp_jax.model.fns import from_linen, from_nnx
from fsdp_jax.train.build import build
from fsdp_jax.train.shard_model import shard_model
from fsdp_jax.verify.compare import strategy_mesh_shape
from helpers import example

STRATEGIES = ("full_shard", "shard_grad_op", "shard_opt", "no_shard", "hybrid_shard")
SGD = optax.sgd(0.05, momentum=0.9)
MIN_SHARD = 256  # small enough that the conv kernels and dense layers shard here
STEPS = 5


# ----------------------------------------------------------------------------- the models


def resnet():
    net = ResNet(stage_sizes=[1, 1], block_cls=ResNetBlock, num_classes=4, num_filters=8)
    return from_linen(net, jax.ShapeDtypeStruct((16, 16, 16, 3), jnp.float32), axis_names=("batch",))


def image_batches(n, seed=0):
    k = jax.random.key(seed)
    return [
        {
            "image": jax.random.normal(jax.random.fold_in(k, i), (16, 16, 16, 3)),
            "label": jax.random.randint(jax.random.fold_in(k, 100 + i), (16,), 0, 4),
        }
        for i in range(n)
    ]


def resnet_loss(model):
    def loss_fn(params, batch, *, state, rng, train):
        logits, state = model.apply(params, batch["image"], state=state, rng=rng, train=train)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean(), state

    return loss_fn


class BnDropNet(nnx.Module):
    """x (B, 32) -> (B, 4): Linear (no bias: BatchNorm removes it, its gradient is
    zero up to rounding), BatchNorm, relu, Dropout, Linear."""

    def __init__(self, rngs: nnx.Rngs, rate: float = 0.3):
        self.up = nnx.Linear(
            32,
            64,
            use_bias=False,
            rngs=rngs,
            kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), ("embed", "mlp")),
        )
        self.bn = nnx.BatchNorm(64, rngs=rngs)
        self.drop = nnx.Dropout(rate, rngs=rngs)
        self.out = nnx.Linear(64, 4, rngs=rngs)

    def __call__(self, x):
        return self.out(self.drop(nnx.relu(self.bn(self.up(x)))))


def nnx_model(rate=0.3):
    return from_nnx(lambda rngs: BnDropNet(rngs, rate))


def vector_batches(n, seed=0):
    k = jax.random.key(seed)
    return [
        {
            "x": jax.random.normal(jax.random.fold_in(k, i), (16, 32)),
            "y": jax.random.normal(jax.random.fold_in(k, 100 + i), (16, 4)),
        }
        for i in range(n)
    ]


def nnx_loss(model):
    def loss_fn(params, batch, *, state, rng, train):
        out, state = model.apply(params, batch["x"], state=state, rng=rng, train=train)
        return jnp.mean((out - batch["y"]) ** 2), state

    return loss_fn


MODELS = {"flax_resnet": (resnet, resnet_loss, image_batches), "nnx_bn_dropout": (nnx_model, nnx_loss, vector_batches)}


def mesh_for(strategy, n=8):
    return fj.make_mesh(*strategy_mesh_shape(strategy, n), devices=jax.devices()[:n])


def train(name, strategy, n, steps=STEPS, **step_kw):
    """(sharded model, its train step, host states after 0..steps steps, losses)."""
    make, make_loss, make_batches = MODELS[name]
    model = make()
    sm = shard_model(
        model,
        SGD,
        mesh_for(strategy, n),
        strategy,
        rng=jax.random.key(0),
        min_shard_size=MIN_SHARD,
        max_replicated_fraction=None,
    )
    step = sm.train_step(make_loss(model), **step_kw)
    state, states, losses = sm.state, [jax.device_get(sm.state)], []
    for b in make_batches(steps):
        state, m = step(state, b)
        states.append(jax.device_get(state))
        losses.append(float(m["loss"]))
    return sm, step, states, losses


@pytest.fixture(scope="module")
def trained():
    """`train`, memoised per program and step count: one traced and compiled step per (model,
    strategy, devices, step options) serves the parity, the plain-Flax, the microbatch and the
    resume tests (each reads the host states after the steps it needs)."""
    runs = {}

    def get(name, strategy, n, steps=STEPS, **step_kw):
        key = (name, strategy, n, steps, tuple(sorted(step_kw.items())))
        if key not in runs:
            runs[key] = train(name, strategy, n, steps, **step_kw)
        return runs[key]

    return get


def tree_max_diff(a, b):
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y)), initial=0.0))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


# ----------------------------------------------------------------------------- parity


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_parity_with_one_device_under_every_strategy(name, trained):
    """Loss (rel <= 1e-5), params and model state after 5 steps agree with one device
    under all five strategies: batch statistics are over the global batch, dropout
    masks come from fold_in(run key, step), the same on 1 and 8 devices."""
    _, _, ref_states, ref_losses = trained(name, "no_shard", 1)
    ref = ref_states[-1]
    for strategy in STRATEGIES:
        sm, _, states, losses = trained(name, strategy, 8)
        state = states[-1]
        np.testing.assert_allclose(losses, ref_losses, rtol=1e-5, err_msg=strategy)
        assert tree_max_diff(state.params, ref.params) < 1e-5, strategy
        assert tree_max_diff(state.model_state, ref.model_state) < 1e-5, strategy
        if strategy == "full_shard":  # the params really are sharded, the state follows the rules
            specs = [x.sharding.spec for x in jax.tree.leaves(sm.state.params)]
            assert any(any(e is not None for e in s) for s in specs)
    # the state moved (BatchNorm statistics updated by the step): against the state at init
    assert tree_max_diff(ref.model_state, ref_states[0].model_state) > 1e-3


@pytest.mark.slow
def test_resnet_matches_a_plain_flax_training_loop(trained):
    """Independent reference: Flax's own `apply(..., mutable=["batch_stats"])` loop on
    one device, no fsdp_jax in the step, vs full_shard on 8 devices."""
    net = ResNet(stage_sizes=[1, 1], block_cls=ResNetBlock, num_classes=4, num_filters=8)
    variables = jax.jit(lambda k: net.init(k, jnp.zeros((16, 16, 16, 3))))(jax.random.key(0))
    params, stats = variables["params"], variables["batch_stats"]
    opt = SGD.init(params)

    @jax.jit
    def step(params, stats, opt, batch):
        def f(p):  # pmap-era axis name bound to size 1, as the adapter does
            logits, new = jax.vmap(
                lambda x: net.apply({"params": p, "batch_stats": stats}, x, train=True, mutable=["batch_stats"]),
                axis_name="batch",
                axis_size=1,
                in_axes=None,
            )(batch["image"])
            loss = optax.softmax_cross_entropy_with_integer_labels(logits[0], batch["label"]).mean()
            return loss, jax.tree.map(lambda x: x[0], new["batch_stats"])

        (loss, new_stats), g = jax.value_and_grad(f, has_aux=True)(params)
        u, opt = SGD.update(g, opt, params)
        return optax.apply_updates(params, u), new_stats, opt, loss

    ref_losses = []
    for b in image_batches(STEPS):
        params, stats, opt, loss = step(params, stats, opt, b)
        ref_losses.append(float(loss))
    _, _, states, losses = trained("flax_resnet", "full_shard", 8)  # the parity test's run
    state = states[-1]
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert tree_max_diff(state.params, params) < 1e-5
    assert tree_max_diff(state.model_state["batch_stats"], stats) < 1e-5


def test_dropout_key_changes_per_step_and_eval_is_deterministic():
    """The step's key is fold_in(run key, step): another run key gives other masks;
    eval runs without dropout and with the running statistics, and repeats exactly."""
    model = nnx_model()
    loss_fn = nnx_loss(model)
    mesh = mesh_for("full_shard")
    sm = shard_model(model, SGD, mesh, "full_shard", rng=jax.random.key(0), max_replicated_fraction=None)
    batch = vector_batches(1)[0]

    def first_loss(rng):
        state = jax.tree.map(lambda x: x.copy(), sm.state)  # the step donates
        return float(sm.train_step(loss_fn, rng=rng)(state, batch)[1]["loss"])

    assert first_loss(jax.random.key(1)) == first_loss(jax.random.key(1))
    assert first_loss(jax.random.key(1)) != first_loss(jax.random.key(2))
    ev = sm.eval_step(loss_fn)
    a = float(ev(sm.state.params, sm.state.model_state, batch)["loss"])
    assert a == float(ev(sm.state.params, sm.state.model_state, batch)["loss"])
    # eval = the module in eval mode by hand: no dropout, BatchNorm on its running averages

    @jax.jit  # one program, not the module op by op
    def by_hand(params, model_state, batch):
        module = model.bind(params, model_state)
        module.eval()
        return jnp.mean((module(batch["x"]) - batch["y"]) ** 2)

    want = float(by_hand(jax.device_get(sm.state.params), jax.device_get(sm.state.model_state), batch))
    np.testing.assert_allclose(a, want, rtol=1e-6)


@pytest.mark.slow
def test_microbatches_thread_the_state_and_agree_with_one_device(trained):
    _, _, ref, ref_losses = trained("nnx_bn_dropout", "no_shard", 1, steps=3, microbatches=2)
    _, _, st, losses = trained("nnx_bn_dropout", "full_shard", 8, steps=3, microbatches=2)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert tree_max_diff(st[3].model_state, ref[3].model_state) < 1e-5
    one = trained("nnx_bn_dropout", "full_shard", 8)[2][3]  # the parity test's run, after 3 of its steps
    assert tree_max_diff(st[3].model_state, one.model_state) > 1e-6  # two updates per step, not one


# ----------------------------------------------------------------------------- every door


def test_explain_bytes_and_build_list_the_state():
    model = resnet()
    sm = shard_model(
        model,
        SGD,
        mesh_for("full_shard"),
        "full_shard",
        rng=jax.random.key(0),
        min_shard_size=MIN_SHARD,
        max_replicated_fraction=None,
    )
    text = sm.explain()
    state_lines = [ln for ln in text.splitlines() if ln.startswith("state:")]
    assert len(state_lines) == len(jax.tree.leaves(sm.state.model_state)) == 12
    assert all("(model state, not trained)" in ln and "replicated" in ln for ln in state_lines)
    assert "state:batch_stats/bn_init/mean" in text
    b = sm.bytes_per_device()
    stats_bytes = sum(x.size * 4 for x in jax.tree.leaves(sm.state.model_state))  # replicated
    assert b["model_state"] == stats_bytes and b["total"] == b["params"] + b["opt_state"] + stats_bytes + 4
    built = build(
        model, SGD, mesh_for("full_shard"), "full_shard", min_shard_size=MIN_SHARD, max_replicated_fraction=None
    )
    assert state_bytes_per_device(built.abstract_state)["model_state"] == stats_bytes
    # a large state leaf shards by the fallback rule under a sharding strategy, not otherwise
    big = fj.make_plan(
        {"w": jax.ShapeDtypeStruct((64, 512), jnp.float32)},
        SGD,
        mesh_for("full_shard"),
        "full_shard",
        abstract_model_state={"stats": jax.ShapeDtypeStruct((1024, 64), jnp.float32)},
    )
    assert big.model_state["stats"].spec[0] in (("data", "fsdp"), "fsdp")
    rep = fj.make_plan(
        {"w": jax.ShapeDtypeStruct((64, 512), jnp.float32)},
        SGD,
        mesh_for("no_shard"),
        "no_shard",
        abstract_model_state={"stats": jax.ShapeDtypeStruct((1024, 64), jnp.float32)},
    )
    assert all(e is None for e in rep.model_state["stats"].spec)


@pytest.mark.slow
def test_verify_compares_params_and_model_state():
    """verify (1 device vs 8) on both models: the model state is placed from the
    reference and compared per leaf (`state:` paths) with the params.

    The NNX model passes verify's default SGD tolerance (param rtol 1e-6 per leaf).
    Flax's ResNet does not: its zero-initialised BatchNorm biases (scale_init zeros in
    each block's second norm) get gradients that are sums over 4096 positions which
    largely cancel, so after one step the leaf differs by ~1.2e-5 relative (8.9e-7
    absolute) from one device, from the order of the cross-device sum alone; its loss
    agrees to 1.7e-7. It passes the table's `adaptive-f32` entry (param rtol 5e-5)."""
    model = nnx_model()
    report = fj.verify(
        model,
        SGD,
        nnx_loss(model),
        batches=vector_batches(3),
        steps=3,
        strategies=["full_shard", "hybrid_shard"],
        min_shard_size=MIN_SHARD,
        rng=jax.random.key(3),
    )
    assert report.passed and report.tolerance.name == "sgd-f32", report.format()
    assert report.strategies["full_shard"].state_bytes["model_state"] == 2 * 64 * 4
    model = resnet()
    strict = fj.verify(
        model,
        SGD,
        resnet_loss(model),
        batches=image_batches(3),
        steps=3,
        strategies=["full_shard"],
        min_shard_size=MIN_SHARD,
    )
    assert not strict.passed and "BatchNorm" in strict.strategies["full_shard"].worst_leaf
    assert max(strict.strategies["full_shard"].loss_rel_diff) < 1e-6
    report = fj.verify(
        model,
        SGD,
        resnet_loss(model),
        batches=image_batches(3),
        steps=3,
        strategies=["full_shard", "hybrid_shard"],
        min_shard_size=MIN_SHARD,
        tolerance="adaptive-f32",
    )
    assert report.passed, report.format()


def test_verify_sees_a_per_device_batch_statistic():
    """What verify is for: BatchNorm statistics taken per device (a shard_map over the
    batch without a pmean) differ from the global batch's, and verify says so."""
    from jax.sharding import PartitionSpec as P

    model = nnx_model(rate=0.0)

    def loss_fn(params, batch, *, state, rng, train):
        def local(x, y):  # each device normalises its own rows: the classic DDP BatchNorm bug
            out, _ = model.apply(params, x, state=state, rng=rng, train=train)
            return jnp.mean((out - y) ** 2)[None]

        mesh = jax.sharding.get_abstract_mesh()
        per = jax.shard_map(
            local,
            mesh=mesh,
            in_specs=(P(("data", "fsdp")), P(("data", "fsdp"))),
            out_specs=P(("data", "fsdp")),
            check_vma=False,
        )(batch["x"], batch["y"])
        return jnp.mean(per), state

    report = fj.verify(
        model,
        SGD,
        loss_fn,
        batches=vector_batches(2),
        steps=2,
        strategies=["full_shard"],
        min_shard_size=MIN_SHARD,
        rng=jax.random.key(3),
    )
    assert not report.passed
    assert report.strategies["full_shard"].loss_rel_diff[0] > 1e-3


# ----------------------------------------------------------------------------- checkpoints


def _abstract(state):
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), state)


@pytest.mark.slow
@pytest.mark.parametrize("name", list(MODELS))
def test_resume_with_state_is_bit_exact_and_restores_onto_another_mesh(name, tmp_path, trained):
    make, _, make_batches = MODELS[name]
    model, batches = make(), make_batches(STEPS)

    def fresh(strategy="full_shard"):
        return shard_model(
            model,
            SGD,
            mesh_for(strategy),
            strategy,
            rng=jax.random.key(0),
            min_shard_size=MIN_SHARD,
            max_replicated_fraction=None,
        )

    # the straight run is the parity test's full_shard run (the same call, the same batches); its
    # compiled step (the run key is shard_model's, key(0), as fresh()'s) trains the split run too
    _, step, states, _ = trained(name, "full_shard", 8)
    straight = states[-1]

    sm = fresh()
    state = sm.state
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        for i, b in enumerate(batches[:3]):
            state, _ = step(state, b)
        ckpt.save(3, state)
        saved = jax.device_get(state)
    del state
    sm2 = fresh()  # a new process's view: the same call, the same run key
    restored = Checkpointer(tmp_path / "ckpt", read_only=True).restore(_abstract(sm2.state)).state
    assert int(restored.step) == 3
    for b in batches[3:]:
        restored, _ = step(restored, b)
    resumed = jax.device_get(restored)
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(a, b)  # bit-exact: params, optimizer state, model state
    # onto another mesh (2 x 4 hybrid_shard): the same values, the other layout
    other = fresh("hybrid_shard")
    back = Checkpointer(tmp_path / "ckpt", read_only=True).restore(_abstract(other.state)).state
    for a, b in zip(jax.tree.leaves(jax.device_get(back)), jax.tree.leaves(saved)):
        np.testing.assert_array_equal(a, b)
    leaf = jax.tree.leaves(back.model_state)[0]
    assert leaf.sharding == jax.tree.leaves(other.state.model_state)[0].sharding


class _OldTrainState(struct.PyTreeNode):
    """The TrainState of releases before model state: step, params, opt_state."""

    step: jax.Array
    params: object
    opt_state: object


def test_old_checkpoint_without_model_state_still_restores(tmp_path):
    """A checkpoint written by the old three-field TrainState restores bit-exactly into
    today's TrainState for a model without state (model_state stays None)."""
    params = {"w": jnp.arange(64 * 512, dtype=jnp.float32).reshape(64, 512) / 1e4, "b": jnp.ones((512,))}
    sm = shard_model(params, SGD, mesh_for("full_shard"), "full_shard")
    assert sm.state.model_state is None
    old = _OldTrainState(step=jnp.asarray(7, jnp.int32), params=sm.state.params, opt_state=sm.state.opt_state)
    with Checkpointer(tmp_path / "ckpt", async_save=False) as ckpt:
        ckpt.save(7, old)
    r = Checkpointer(tmp_path / "ckpt", read_only=True).restore(_abstract(sm.state)).state
    assert isinstance(r, fj.TrainState) and r.model_state is None and int(r.step) == 7
    for a, b in zip(jax.tree.leaves(r), jax.tree.leaves(old)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    # and the leaves of a stateless TrainState are exactly the old ones (same state bytes)
    assert len(jax.tree.leaves(sm.state)) == len(jax.tree.leaves(old))


def test_checkpoint_with_state_onto_a_model_without_names_the_state(tmp_path):
    """Restoring a checkpoint that holds model state onto a stateless target (or the
    reverse) is a CheckpointError naming the model_state paths, not a fallback."""
    from fsdp_jax.checkpoint import CheckpointError

    params = {"w": jnp.ones((8, 4))}
    opt = SGD.init(params)
    with_state = fj.TrainState(
        step=jnp.asarray(1, jnp.int32), params=params, opt_state=opt, model_state={"bn": {"mean": jnp.zeros((4,))}}
    )
    without = fj.TrainState(step=jnp.asarray(1, jnp.int32), params=params, opt_state=opt)
    for saved, target, pattern in (
        (with_state, without, r"model_state/bn/mean: only in the checkpoint"),
        (without, with_state, r"model_state/bn/mean: not in the checkpoint"),
    ):
        d = tmp_path / pattern.split(":")[1].strip().split()[0]
        with Checkpointer(d, async_save=False) as ckpt:
            ckpt.save(1, saved)
        abstract = jax.tree.map(
            lambda x: jax.ShapeDtypeStruct(
                x.shape, x.dtype, sharding=jax.sharding.SingleDeviceSharding(jax.devices()[0])
            ),
            target,
        )
        with pytest.raises(CheckpointError, match=pattern) as e:
            Checkpointer(d, read_only=True).restore(abstract)
        assert "\n" not in str(e.value)


# ----------------------------------------------------------------------------- bad input


class _Counting(nn.Module):
    """A Linen module with a collection nobody declared ('counters')."""

    @nn.compact
    def __call__(self, x):
        c = self.variable("counters", "n", lambda: jnp.zeros((), jnp.int32))
        c.value += 1
        return nn.Dense(4)(x)


def _nnx_state_loss(model, ret):
    def loss_fn(params, batch, *, state, rng, train):
        out, new = model.apply(params, batch["x"], state=state, rng=rng, train=train)
        return ret(jnp.mean((out - batch["y"]) ** 2), new)

    return loss_fn


BAD = [
    (
        "forgets the state",
        lambda: _nnx_state_loss(nnx_model(), lambda loss, new: loss),
        r"loss_fn returned a .*not \(loss, new_state\).*bn/mean",
    ),
    (
        "drops a leaf",
        lambda: _nnx_state_loss(nnx_model(), lambda loss, new: (loss, {"bn": {"mean": new["bn"]["mean"]}})),
        r"does not match the model state: it lacks bn/var",
    ),
    (
        "adds a leaf",
        lambda: _nnx_state_loss(nnx_model(), lambda loss, new: (loss, {**new, "extra": jnp.zeros(3)})),
        r"does not match the model state: it has extra",
    ),
    (
        "changes a shape",
        lambda: _nnx_state_loss(
            nnx_model(), lambda loss, new: (loss, {"bn": {"mean": new["bn"]["mean"][:3], "var": new["bn"]["var"]}})
        ),
        r"model state leaf bn/mean changed shape \(64,\) -> \(3,\)",
    ),
]


@pytest.mark.parametrize("what,make_loss,pattern", BAD, ids=[b[0] for b in BAD])
def test_bad_loss_contract_is_one_line_before_anything_runs(what, make_loss, pattern):
    model = nnx_model()
    sm = shard_model(
        model, SGD, mesh_for("no_shard", 1), "no_shard", rng=jax.random.key(0), max_replicated_fraction=None
    )
    step = sm.train_step(make_loss())
    with pytest.raises(StateError, match=pattern) as e:
        step.lower(sm.state, vector_batches(1)[0])  # tracing: nothing has run
    assert "\n" not in str(e.value)


BAD_MODELS = [
    (
        "undeclared collection",
        lambda: from_linen(_Counting(), jnp.zeros((2, 3))),
        r"from_linen: _Counting creates the collection 'counters', which is neither trained \('params'\) "
        r"nor declared as state",
    ),
    (
        "NNX Rngs and no run key",
        lambda: build(
            nnx_model(),
            SGD,
            mesh_for("no_shard", 1),
            "no_shard",
            loss_fn=lambda p, b: 0.0,
            max_replicated_fraction=None,
        ),
        r"draws random numbers .* pass rng=",
    ),
    (
        "place without the state",
        lambda: build(nnx_model(), SGD, mesh_for("no_shard", 1), "no_shard", max_replicated_fraction=None).place(
            jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), nnx_model().abstract_params)
        ),
        r"this model has state; pass place\(params, model_state\)",
    ),
]


@pytest.mark.parametrize("what,call,pattern", BAD_MODELS, ids=[b[0] for b in BAD_MODELS])
def test_bad_model_state_setup_is_one_line(what, call, pattern):
    with pytest.raises(StateError, match=pattern) as e:
        call()
    assert "\n" not in str(e.value)


def test_state_error_is_bad_input_for_the_cli():

    assert issubclass(StateError, BAD_INPUT)


def test_declared_collection_trains():
    model = from_linen(_Counting(), jax.ShapeDtypeStruct((8, 3), jnp.float32), state=("counters",))
    sm = shard_model(
        model, SGD, mesh_for("full_shard"), "full_shard", rng=jax.random.key(0), max_replicated_fraction=None
    )

    def loss_fn(params, batch, *, state, rng, train):
        out, state = model.apply(params, batch, state=state, rng=rng, train=train)
        return jnp.mean(out**2), state

    step = sm.train_step(loss_fn)
    state = sm.state
    assert int(state.model_state["counters"]["n"]) == 1  # init ran the module once
    for _ in range(3):
        state, _ = step(state, jnp.ones((8, 3)))
    assert int(state.model_state["counters"]["n"]) == 4


@pytest.mark.slow
def test_resnet_example_runs_and_learns(capsys):
    example("resnet_batchnorm").main(steps=10)
    out = capsys.readouterr().out
    losses = [float(x) for x in __import__("re").findall(r"^step \d+ loss ([\d.]+)$", out, __import__("re").M)]
    assert len(losses) == 10 and losses[-1] < losses[0], out
    assert "model_state 576" in out and "eval loss" in out


@pytest.mark.slow
def test_kill_9_then_resume_is_bit_exact(tmp_path):
    """examples/resnet_batchnorm.py --ckpt-dir in its own process, killed with SIGKILL
    after step 3 was printed (steps save synchronously, so step 2 at least is
    committed; the next save may be mid-write), then resumed (its main(), in this
    process) to step 6: params, optimizer state and BatchNorm statistics equal an
    uninterrupted run bit for bit."""
    import os
    import pathlib
    import signal
    import subprocess
    import sys
    import time

    root = pathlib.Path(__file__).resolve().parents[1]
    ckpt = tmp_path / "ckpt"
    env = dict(
        os.environ, JAX_COMPILATION_CACHE_DIR=str(root / ".jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )
    proc = subprocess.Popen(
        [sys.executable, str(root / "examples" / "resnet_batchnorm.py"), "--steps", "6", "--ckpt-dir", str(ckpt)],
        cwd=root,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
    )
    try:
        end, seen = time.monotonic() + 300, ""
        while time.monotonic() < end and not seen.startswith("step 3 "):
            seen = proc.stdout.readline()
            if not seen and proc.poll() is not None:
                break
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert seen.startswith("step 3 ") and proc.returncode == -signal.SIGKILL
    killed_at = Checkpointer(ckpt, read_only=True).latest_step()
    assert 2 <= killed_at < 6
    ex = example("resnet_batchnorm")
    resumed = jax.device_get(ex.main(steps=6, ckpt_dir=str(ckpt)))
    straight = jax.device_get(ex.main(steps=6))
    assert int(resumed.step) == 6
    for a, b in zip(jax.tree.leaves(resumed), jax.tree.leaves(straight)):
        np.testing.assert_array_equal(a, b)
