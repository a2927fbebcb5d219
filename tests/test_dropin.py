"""Drop-in FSDP for any Flax project (`fsdp_jax.train.shard_model.shard_model`): NNX, Linen
and plain pytrees, init functions and materialised params, unknown logical names,
frozen params; parity with a single device; the examples run."""

import os
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

import fsdp_jax as fj
from fsdp_jax.errors import ReplicatedWarning
from fsdp_jax.model.fns import from_linen, from_nnx
from fsdp_jax.train.shard_model import shard_model
from helpers import example, max_abs_diff, reference_train

ROOT = pathlib.Path(__file__).resolve().parents[1]
EXAMPLES = ROOT / "examples"
SGD = optax.sgd(0.1, momentum=0.9)


def train(sm, loss_fn, batches, **step_kw):
    step = sm.train_step(loss_fn, **step_kw)
    state, losses = sm.state, []
    for b in batches:
        state, metrics = step(state, b)
        losses.append(float(metrics["loss"]))
    return state, losses


def assert_parity(state, losses, ref):
    ref_params, ref_losses = ref
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    assert max_abs_diff(state.params, ref_params) < 1e-6
    assert losses[-1] < losses[0]


def check_example_output(out: str):
    losses = [float(x) for x in re.findall(r"^step \d+ loss ([\d.]+)$", out, re.M)]
    assert len(losses) == 8 and losses[-1] < losses[0], out
    m = re.search(r"^per-device bytes: params (\d+) opt_state (\d+) total (\d+)$", out, re.M)
    assert m and int(m.group(1)) > 0, out


@pytest.mark.slow
def test_example_runs_and_learns_as_a_script():
    """`python examples/nnx_mlp.py`, the way a user runs it (its own process, its own 8 devices)."""
    env = dict(
        os.environ, JAX_COMPILATION_CACHE_DIR=str(ROOT / ".jax_cache"), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "nnx_mlp.py"), "--steps", "8"],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    check_example_output(out.stdout)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["linen_transformer", "pytree_model"])
def test_example_runs_and_learns(name, capsys):
    """The other examples' main(), in this process (the same 8 CPU devices)."""
    capsys.readouterr()
    example(name).main(steps=8)
    check_example_output(capsys.readouterr().out)


@pytest.mark.slow
def test_nnx_example_parity():
    ex = example("nnx_mlp")
    model = ex.make_model()
    sm = shard_model(model, SGD, fj.make_mesh(fsdp=8), "full_shard", rng=jax.random.key(0))
    assert sm.state.params["blocks"][0]["up"]["kernel"].sharding.spec == P("fsdp", None)
    loss_fn, batches = ex.make_loss_fn(model), ex.make_batches(5)
    state, losses = train(sm, loss_fn, batches)
    assert_parity(state, losses, reference_train(loss_fn, SGD, jax.jit(model.init)(jax.random.key(0)), batches))
    assert state.params["blocks"][1]["down"]["kernel"].sharding.spec == P(None, "fsdp")  # stays sharded


@pytest.mark.slow
def test_linen_example_parity_with_logical_names():
    ex = example("linen_transformer")
    model = ex.make_model()
    sm = shard_model(model, SGD, fj.make_mesh(fsdp=8), "full_shard", rng=jax.random.key(0))
    notes = {r.path: r.notes for r in sm.plan.rows}
    assert notes["block_0/attn/wq"] == (fj.Note(fj.Why.LOGICAL, mapped=(("embed", ("fsdp",)),)),)
    assert sm.state.params["block_0"]["mlp"]["wo"].sharding.spec == P(None, "fsdp")
    loss_fn, batches = ex.make_loss_fn(model), ex.make_batches(5)
    state, losses = train(sm, loss_fn, batches)
    assert_parity(state, losses, reference_train(loss_fn, SGD, jax.jit(model.init)(jax.random.key(0)), batches))


@pytest.mark.slow
def test_pytree_example_parity_from_init_fn_and_from_materialised_params():
    ex = example("pytree_model")
    mesh = fj.make_mesh(fsdp=8)
    sm = shard_model(ex.init, SGD, mesh, "full_shard", rng=jax.random.key(0))
    assert isinstance(sm.state.params, ex.Classifier) and sm.apply is None
    assert sm.state.params.hidden[1].w.sharding.spec == P("fsdp", None)  # fallback rule
    p0 = jax.jit(ex.init)(jax.random.key(0))
    placed = shard_model(p0, SGD, mesh, "full_shard")  # already materialised: placed, not re-initialised
    assert max_abs_diff(placed.state.params, sm.state.params) == 0.0
    assert jax.tree.map(lambda x: x.sharding, placed.state) == jax.tree.map(lambda x: x.sharding, sm.state)
    batches = ex.make_batches(5)
    state, losses = train(sm, ex.loss_fn, batches)
    assert_parity(state, losses, reference_train(ex.loss_fn, SGD, p0, batches))
    assert not p0.hidden[0].w.is_deleted()  # the step donated copies, not the caller's arrays


@pytest.mark.slow
def test_materialised_nnx_module_state_and_linen_variables():
    nnx_ex, linen_ex = example("nnx_mlp"), example("linen_transformer")
    mesh = fj.make_mesh(fsdp=8)
    # built, called and initialised by compiled programs (eagerly, each op was one: 92 compiles)
    with nnx.use_eager_sharding(False):
        module = nnx.jit(lambda: nnx_ex.MLP(rngs=nnx.Rngs(0)))()
    from_fn = shard_model(nnx_ex.make_model(), SGD, mesh, rng=jax.random.key(0))
    x = jnp.ones((8, nnx_ex.D_MODEL))
    built = [shard_model(given, SGD, mesh) for given in (module, nnx.state(module, nnx.Param))]  # a module, its State
    for sm in built:
        assert jax.tree.map(lambda a: a.sharding.spec, sm.state.params) == jax.tree.map(
            lambda a: a.sharding.spec, from_fn.state.params
        )
    y = jax.jit(built[0].apply)(nnx.to_pure_dict(nnx.state(module, nnx.Param)), x)  # the module instance's
    np.testing.assert_allclose(y, nnx.jit(lambda m, x: m(x))(module, x), rtol=1e-6)

    tokens = jnp.zeros((1, linen_ex.CFG.max_len), jnp.int32)
    variables = jax.jit(linen_ex.Transformer(linen_ex.CFG).init)(jax.random.key(0), tokens)  # boxed
    init_fn = lambda rng: linen_ex.Transformer(linen_ex.CFG).init(rng, tokens)  # noqa: E731
    for given, rng in ((variables, None), (init_fn, jax.random.key(0))):  # materialised / sharded init
        sm = shard_model(given, SGD, mesh, rng=rng)
        assert sm.state.params["params"]["block_0"]["attn"]["wo"].sharding.spec == P(None, None, "fsdp")
        assert not any(
            isinstance(v, nn.LogicallyPartitioned)
            for v in jax.tree.leaves(sm.state.params, is_leaf=lambda v: isinstance(v, nn.LogicallyPartitioned))
        )
    assert max_abs_diff(sm.state.params, nn.unbox(variables)) < 1e-6


class UnknownNames(nn.Module):
    """Linen MLP annotated with names the rules table does not know."""

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        w1 = self.param("w1", nn.with_logical_partitioning(init, ("features", "hidden")), (64, 512))
        w2 = self.param("w2", nn.with_logical_partitioning(init, ("hidden", "embed")), (512, 64))
        return jnp.tanh(x @ w1) @ w2


def test_linen_names_not_in_the_rules_table_fall_back_and_train():
    model = from_linen(UnknownNames(), jax.ShapeDtypeStruct((1, 64), jnp.float32))
    with pytest.warns(fj.UnknownNamesWarning, match="features, hidden"):
        sm = shard_model(model, SGD, fj.make_mesh(fsdp=8), rng=jax.random.key(0))
    rows = {r.path: r for r in sm.plan.rows}
    Why = fj.Why
    assert rows["w1"].kinds == (Why.LOGICAL, Why.UNKNOWN_NAMES, Why.FALLBACK)
    assert rows["w1"].notes[1].names == ("features", "hidden") and rows["w1"].notes[2].dim == 1
    assert rows["w1"].spec == P(None, "fsdp")
    assert rows["w2"].kinds == (Why.LOGICAL, Why.UNKNOWN_NAMES) and rows["w2"].notes[1].names == ("hidden",)
    assert rows["w1"].reason in sm.explain()

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((model.apply(params, x) - y) ** 2)

    x = jax.random.normal(jax.random.key(1), (16, 64))
    batches = [(x, jnp.sin(x))] * 3
    state, losses = train(sm, loss_fn, batches)
    assert_parity(state, losses, reference_train(loss_fn, SGD, jax.jit(model.init)(jax.random.key(0)), batches))


class LinenAttention(nn.Module):
    """Flax's own attention layer, annotated as Flax's lm1b example does: two logical
    names (embed, kv) on its 3-D (embed, heads, head_dim) kernels."""

    @nn.compact
    def __call__(self, x):
        init = nn.with_logical_partitioning(nn.initializers.xavier_uniform(), ("embed", "kv"))
        x = x + nn.MultiHeadDotProductAttention(
            num_heads=4, qkv_features=64, kernel_init=init, use_bias=False, deterministic=True
        )(x)
        return nn.Dense(
            64,
            kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp")),
            use_bias=False,
        )(x)


def test_linen_attention_with_fewer_names_than_dims_shards_and_trains():
    model = from_linen(LinenAttention(), jax.ShapeDtypeStruct((1, 8, 64), jnp.float32))
    with pytest.warns(ReplicatedWarning):  # the small out kernel (16 KiB) replicates
        sm = shard_model(model, SGD, fj.make_mesh(fsdp=8), rng=jax.random.key(0))
    rows = {r.path: r for r in sm.plan.rows}
    q = rows["MultiHeadDotProductAttention_0/query/kernel"]
    assert q.shape == (64, 4, 16) and q.spec == P("fsdp", None, None)
    assert q.notes[1] == fj.Note(fj.Why.UNNAMED_TRAILING, dims=(2,))
    # the out kernel is (heads, head_dim, embed) but named (embed, kv) on its leading dims:
    # heads=4 does not divide by 8, and 4096 elements are under min_shard_size: replicated
    out = rows["MultiHeadDotProductAttention_0/out/kernel"]
    assert out.shape == (4, 16, 64) and out.replicated
    assert out.kinds == (fj.Why.LOGICAL, fj.Why.UNNAMED_TRAILING, fj.Why.NOT_DIVISIBLE, fj.Why.THRESHOLD)
    assert q.reason in sm.explain()

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((model.apply(params, x) - y) ** 2)

    x = jax.random.normal(jax.random.key(1), (16, 8, 64))
    batches = [(x, jnp.sin(x))] * 3
    state, losses = train(sm, loss_fn, batches)
    assert_parity(state, losses, reference_train(loss_fn, SGD, jax.jit(model.init)(jax.random.key(0)), batches))


def test_readme_plain_call_runs_a_small_unannotated_model():
    """Two nnx.Linear(64, 128) layers: every leaf is under min_shard_size, so all of it is
    replicated; a few hundred KiB cost nothing, so this warns instead of failing."""

    class Two(nnx.Module):
        def __init__(self, rngs):
            self.a, self.b = nnx.Linear(64, 128, rngs=rngs), nnx.Linear(128, 64, rngs=rngs)

        def __call__(self, x):
            return self.b(jax.nn.relu(self.a(x)))

    with pytest.warns(ReplicatedWarning, match="100.0% of parameter bytes"):
        sm = shard_model(from_nnx(Two), optax.adamw(1e-3), fj.make_mesh(fsdp=8), rng=jax.random.key(0))
    n = (64 * 128 + 128 + 128 * 64 + 64) * 4
    last = sm.explain().splitlines()[-1]
    assert last == f"total: {n:,} B/device of {n:,} B of params; replicated over fsdp: 100.0% ({n:,} B)"
    with pytest.raises(fj.ShardingError, match="100.0% of parameter bytes"):  # the floor is a setting
        shard_model(
            from_nnx(Two), optax.adamw(1e-3), fj.make_mesh(fsdp=8), rng=jax.random.key(0), min_replicated_bytes=1024
        )


class LoRAMLP(nnx.Module):
    """Frozen base MLP with trainable low-rank adapters (nnx.LoRALinear)."""

    def __init__(self, rngs: nnx.Rngs, d: int = 64, hidden: int = 256, rank: int = 4):
        def lora(n_in, n_out, names):
            return nnx.LoRALinear(
                n_in,
                n_out,
                lora_rank=rank,
                rngs=rngs,
                kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
                a_metadata={"out_sharding": (names[0], None)},
                b_metadata={"out_sharding": (None, names[1])},
            )

        self.up = lora(d, hidden, ("embed", "mlp"))
        self.down = lora(hidden, d, ("mlp", "embed"))

    def __call__(self, x):
        return self.down(jax.nn.gelu(self.up(x)))


def _is_lora(path) -> bool:
    return "lora" in jax.tree_util.keystr(path)


@pytest.mark.slow
def test_frozen_params_lora_finetune():
    model = from_nnx(lambda r: LoRAMLP(r))
    labels = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, _: "train" if _is_lora(path) else "frozen", p
    )
    opt = optax.multi_transform({"train": SGD, "frozen": optax.set_to_zero()}, labels)
    # tiny model: the rank-4 adapters' replicated halves are a large share of its bytes
    sm = shard_model(
        model, opt, fj.make_mesh(fsdp=8), rng=jax.random.key(0), trainable=nnx.LoRAParam, max_replicated_fraction=0.1
    )
    assert sm.trainable == jax.tree_util.tree_map_with_path(lambda p, _: _is_lora(p), model.abstract_params)
    kernel = next(r for r in sm.plan.rows if r.path == "up/kernel")
    assert f"{kernel.reason} (frozen)" in sm.explain() and not sm.trainable["up"]["kernel"]
    # frozen params keep no optimizer state: the state is exactly the adapters' momentum
    lora_bytes = sum(x.size * 4 for p, x in jax.tree_util.tree_flatten_with_path(sm.state.params)[0] if _is_lora(p))
    assert sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(sm.state.opt_state)) == lora_bytes

    def loss_fn(params, batch):
        x, y = batch
        return jnp.mean((model.apply(params, x) - y) ** 2)

    xs = [jax.random.normal(jax.random.key(i), (32, 64)) for i in range(5)]
    batches = [(x, jnp.sin(x)) for x in xs]
    p0 = jax.jit(model.init)(jax.random.key(0))

    # frozen grads are never computed: no gradient reduction of a frozen kernel's shape
    reduce_types = {}
    for name, mask in (("masked", sm.trainable), ("all", None)):
        hlo = sm.train_step(loss_fn, trainable=mask).lower(sm.state, batches[0]).compile().as_text()
        reduce_types[name] = " ".join(
            l.split("=", 1)[1].split(" all-reduce")[0]
            for l in hlo.splitlines()
            if re.search(r"\s(all-reduce|reduce-scatter)(-start)?\(", l)
        )
    assert "f32[256,64]" in reduce_types["all"] and "f32[64,256]" in reduce_types["all"]
    assert "f32[256,64]" not in reduce_types["masked"] and "f32[64,256]" not in reduce_types["masked"]

    state, losses = train(sm, loss_fn, batches)
    assert_parity(state, losses, reference_train(loss_fn, opt, p0, batches))
    assert max_abs_diff(state.params["up"]["kernel"], p0["up"]["kernel"]) == 0.0  # frozen
    assert max_abs_diff(state.params["up"]["lora"]["lora_b"], p0["up"]["lora"]["lora_b"]) > 0  # trained
    assert state.params["up"]["kernel"].sharding.spec == P("fsdp", None)  # frozen params stay sharded

    # the microbatch accumulator carries only the trainable leaves; same result
    sm2 = shard_model(
        model, opt, fj.make_mesh(fsdp=8), rng=jax.random.key(0), trainable=nnx.LoRAParam, max_replicated_fraction=0.1
    )
    state2, losses2 = train(sm2, loss_fn, batches, microbatches=2)
    np.testing.assert_allclose(losses2, losses, rtol=1e-5)
    assert max_abs_diff(state2.params, state.params) < 1e-6


def test_bad_inputs_are_clear_errors():
    mesh = fj.make_mesh(fsdp=8)
    with pytest.raises(ValueError, match=r"pass rng=jax.random.key\(seed\)"):
        shard_model(lambda rng: {"w": jnp.zeros((64, 512))}, SGD, mesh)
    with pytest.raises(TypeError, match=r"params leaf act is a str, not an array"):
        shard_model({"w": jnp.zeros((64, 512)), "act": "relu"}, SGD, mesh)
    with pytest.raises(TypeError, match=r"from_linen\(module, example_input\)"):
        shard_model(UnknownNames(), SGD, mesh)
    with pytest.raises(ValueError, match="is an NNX filter, which needs an NNX model"):
        shard_model({"w": jnp.zeros((64, 512))}, SGD, mesh, trainable=nnx.LoRAParam)
    with pytest.raises(ValueError, match="trainable does not match the params tree"):
        shard_model({"w": jnp.zeros((64, 512))}, SGD, mesh, trainable={"v": True})
