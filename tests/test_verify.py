"""`fsdp_jax.verify.run`: a healthy model passes under every strategy, a model whose result
depends on the device count fails naming the step and the leaf, bad input is one
clear line (VerifyError in the library, exit 2 from scripts/verify.py)."""

import json
import os
import pathlib
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
from fsdp_jax.errors import VerifyError
from fsdp_jax.sharding import axes as ax
from fsdp_jax.verify.report import TOLERANCES, default_tolerance, optimizer_kind
from helpers import call, example, one_line, tiny_llama, token_batches

ROOT = pathlib.Path(__file__).resolve().parents[1]
BATCH_AXES = (ax.DATA, ax.FSDP)
SGD = optax.sgd(0.1, momentum=0.9)
D, H, C = 32, 64, 8  # input features, hidden, classes


def classification_batches(n: int = 3, batch: int = 16, seed: int = 0):
    rng = np.random.default_rng(seed)
    return [
        {"x": rng.normal(size=(batch, D)).astype(np.float32), "y": rng.integers(0, C, (batch,)).astype(np.int32)}
        for _ in range(n)
    ]


def xent(logits, y):
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], axis=-1))


# ----------------------------------------------------------------------------- models


class LinenMLP(nn.Module):
    """Linen MLP with logical names; `center`: "none", "global" (mean over the whole
    batch, correct) or "local" (a shard_map that forgets its pmean: the mean of
    each device's rows only)."""

    center: str = "none"

    @nn.compact
    def __call__(self, x):
        init = nn.initializers.lecun_normal()
        w1 = self.param("w1", nn.with_logical_partitioning(init, (ax.EMBED, ax.MLP)), (D, H))
        w2 = self.param("w2", nn.with_logical_partitioning(init, (ax.MLP, ax.EMBED)), (H, C))
        h = jnp.tanh(x @ w1)
        if self.center != "none":
            h = _center(h, self.center == "global")
        return h @ w2


def per_shard(fn, out_specs=P(BATCH_AXES)):
    """`fn` under shard_map over the batch axes of the current mesh (the train step
    sets it); outside one (shape inference at init) on a one-device mesh."""

    def call(x):
        mesh = None
        if jax.sharding.get_abstract_mesh().empty:
            mesh = fj.make_mesh(1, 1, 1, devices=jax.devices()[:1])
        return jax.shard_map(fn, mesh=mesh, in_specs=P(BATCH_AXES), out_specs=out_specs)(x)

    return call


def _center(h, reduce_across_devices: bool):
    """Subtract the batch mean of `h` (B, F) inside shard_map over the batch axes."""

    def body(hl):
        mean = hl.mean(0, keepdims=True)
        if reduce_across_devices:
            mean = jax.lax.pmean(mean, BATCH_AXES)
        return hl - mean

    return per_shard(body)(h)


def linen_setup(center: str = "none"):
    module = LinenMLP(center)
    model = fj.from_linen(module, jax.ShapeDtypeStruct((1, D), jnp.float32))

    def loss_fn(params, b):
        return xent(model.apply(params, b["x"]), b["y"])

    return model, loss_fn


class NNXMLP(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
        init = nnx.initializers.lecun_normal()
        self.w1 = nnx.Param(nnx.with_partitioning(init, (ax.EMBED, ax.MLP))(rngs.params(), (D, H)))
        self.head = nnx.Param(nnx.with_partitioning(init, (ax.MLP, ax.EMBED))(rngs.params(), (H, C)))

    def features(self, x):
        return jnp.tanh(x @ self.w1[...])


def nnx_setup(reg: str = "none", dropout: str = "none"):
    """NNX MLP. `reg`: an activity penalty on the head, over the batch, reduced across
    devices with "pmean" (correct) or "psum" (the bug: N times too large). It sees
    the features through stop_gradient, so only the head's gradient depends on it.
    `dropout`: "none", "gspmd" (jax.random on the sharded activations: the same bits
    under any sharding) or "shard_map" (the same key on every device: each shard
    draws the mask of the first rows)."""
    model = fj.from_nnx(NNXMLP)

    def loss_fn(params, b):
        m = model.bind(params)
        h = m.features(b["x"])
        if dropout == "gspmd":
            keep = jax.random.bernoulli(jax.random.key(7), 0.5, h.shape)
            h = jnp.where(keep, h / 0.5, 0.0)
        elif dropout == "shard_map":

            def drop(hl):
                keep = jax.random.bernoulli(jax.random.key(7), 0.5, hl.shape)
                return jnp.where(keep, hl / 0.5, 0.0)

            h = per_shard(drop)(h)
        loss = xent(h @ m.head[...], b["y"])
        if reg != "none":
            act = jax.lax.stop_gradient(h) @ m.head[...]
            reduce = jax.lax.pmean if reg == "pmean" else jax.lax.psum

            def penalty(a):
                return reduce(jnp.mean(a * a), BATCH_AXES)

            loss = loss + 0.1 * per_shard(penalty, out_specs=P())(act)
        return loss

    return model, loss_fn


def factory(kind: str = "linen", center: str = "none"):
    """verify's factory spec target (`test_verify:factory`), for the child process."""
    model, loss_fn = linen_setup(center)
    return {
        "model": model,
        "optimizer": SGD,
        "loss_fn": loss_fn,
        "batches": classification_batches(),
        "min_shard_size": 1,
    }


def run(model, loss_fn, strategies=("full_shard", "no_shard"), optimizer=SGD, **kw):
    kw.setdefault("batches", classification_batches())
    return fj.verify(
        model, optimizer, loss_fn, strategies=strategies, devices=8, steps=3, min_shard_size=1, check_init=False, **kw
    )


# ----------------------------------------------------------------------------- healthy models pass


@pytest.mark.slow
def test_reference_llama_passes_under_every_strategy():
    """AdamW (the adaptive tolerance); SGD's is chosen in
    test_tolerance_follows_the_optimizer_and_the_compute_dtype,
    and tests/test_train_step.py holds every strategy to an independent reference with both."""
    model, loss_fn = tiny_llama()
    r = fj.verify(
        model,
        optax.adamw(1e-3),
        loss_fn,
        batches=token_batches(3),
        devices=8,
        steps=3,
        min_shard_size=1,
        check_init=True,
    )
    assert r.tolerance == TOLERANCES["adaptive-f32"]
    assert r.passed, r.format()
    assert list(r.strategies) == ["no_shard", "shard_opt", "shard_grad_op", "full_shard", "hybrid_shard"]
    assert r.reference_loss[-1] < r.reference_loss[0]
    s = r.strategies
    # the sharded layouts really ran: ZeRO-3 holds 1/8 of the params (plus the small
    # replicated norm scales), DDP all of them
    assert 7 * s["full_shard"].state_bytes["params"] < s["no_shard"].state_bytes["params"]
    assert s["hybrid_shard"].mesh == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert "all-gather" in s["full_shard"].collectives_per_step
    assert "all-gather" not in s["no_shard"].collectives_per_step
    # each strategy's own sharded init draws the same bits as one device
    assert [x.init_max_abs_diff for x in s.values()] == [0.0] * 5
    assert all(len(x.loss_rel_diff) == 3 and x.first_divergence is None for x in s.values())


def test_linen_model_passes():
    model, loss_fn = linen_setup()
    r = run(model, loss_fn, strategies=("full_shard", "shard_opt", "hybrid_shard"))
    assert r.passed, r.format()
    assert r.strategies["full_shard"].state_bytes["params"] == (D * H + H * C) * 4 // 8


def test_nnx_model_passes_with_correct_collectives_and_partitionable_dropout():
    model, loss_fn = nnx_setup(reg="pmean", dropout="gspmd")
    r = run(model, loss_fn, optimizer=optax.adamw(1e-2))
    assert r.passed, r.format()
    assert r.optimizer_kind == "adaptive"


def test_dropout_bits_do_not_depend_on_the_sharding_with_either_threefry_setting():
    # jax.random under GSPMD: the same mask on 1 and 8 devices, whether or not the
    # threefry implementation is partitionable (measured on jax 0.10.2; skipped where
    # the flag is gone)
    model, loss_fn = nnx_setup(dropout="gspmd")
    old = jax.config.jax_threefry_partitionable
    try:
        jax.config.update("jax_threefry_partitionable", not old)
    except (AttributeError, KeyError) as e:
        pytest.skip(f"jax_threefry_partitionable is not settable here: {e}")
    try:
        r = run(model, loss_fn, strategies=("full_shard",))
    finally:
        jax.config.update("jax_threefry_partitionable", old)
    assert r.passed, r.format()
    assert r.strategies["full_shard"].max_loss_rel_diff < 1e-6


def test_random_bits_under_gspmd_do_not_depend_on_the_sharding():
    """The fact behind the README's randomness paragraph, for every key implementation
    and both settings of jax_threefry_partitionable (where it is still settable)."""
    mesh = fj.make_mesh(fsdp=8)
    rows = jax.sharding.NamedSharding(mesh, P(BATCH_AXES))
    x = jnp.arange(16 * 64, dtype=jnp.float32).reshape(16, 64) + 1

    def drop(key, x):
        return jnp.where(jax.random.bernoulli(key, 0.5, x.shape), x, 0.0)

    old = getattr(jax.config, "jax_threefry_partitionable", None)
    try:
        for partitionable in (True, False) if old is not None else (None,):
            if partitionable is not None:
                jax.config.update("jax_threefry_partitionable", partitionable)
            for impl in ("threefry2x32", "rbg", "unsafe_rbg"):
                key = jax.random.key(3, impl=impl)
                one = np.asarray(jax.jit(drop)(key, x))
                eight = np.asarray(jax.jit(drop, out_shardings=rows)(key, jax.device_put(x, rows)))
                assert 0.3 < (one == 0).mean() < 0.7
                np.testing.assert_array_equal(one, eight, err_msg=f"{impl} {partitionable}")
    finally:
        if old is not None:
            jax.config.update("jax_threefry_partitionable", old)


def test_correct_shard_map_batch_statistics_pass():
    model, loss_fn = linen_setup("global")
    assert run(model, loss_fn).passed


# ----------------------------------------------------------------------------- broken models fail


_LOCAL: dict[str, fj.VerifyReport] = {}


def local_mean_report() -> fj.VerifyReport:
    """verify's report on the Linen MLP whose shard_map forgets its pmean (full_shard and
    no_shard), run once: the failure test reads it and the JSON round trip carries it."""
    if "r" not in _LOCAL:
        _LOCAL["r"] = run(*linen_setup("local"))
    return _LOCAL["r"]


def test_shard_map_that_forgets_its_cross_device_mean_fails_at_step_1():
    r = local_mean_report()
    assert not r.passed and r.failed == ["full_shard", "no_shard"]
    d = r.strategies["full_shard"].first_divergence
    assert d.step == 1 and d.loss is not None and d.loss > 1e-3
    assert {p for p, _ in d.leaves} == {"w1", "w2"}
    assert "FAIL full_shard: first divergence at step 1: loss rel diff" in r.format()


def test_psum_where_pmean_was_meant_names_the_one_leaf_it_breaks():
    model, loss_fn = nnx_setup(reg="psum")
    r = run(model, loss_fn, strategies=("full_shard",))
    d = r.strategies["full_shard"].first_divergence
    assert d is not None and d.step == 1
    # the penalty's gradient reaches only the head: at step 1 the head alone diverged
    assert [p for p, _ in d.leaves] == ["head"]
    assert d.loss is not None and d.loss > 0.01  # 0.1 * 8 x the penalty instead of 1 x
    assert r.strategies["full_shard"].param_rel_diff[0] > 1e-3


def test_dropout_whose_bits_change_with_the_sharding_fails():
    model, loss_fn = nnx_setup(dropout="shard_map")
    r = run(model, loss_fn, strategies=("shard_grad_op",))
    d = r.strategies["shard_grad_op"].first_divergence
    assert d is not None and d.step == 1 and d.loss is not None


# ----------------------------------------------------------------------------- routing flips


def routed_setup(flip_from: int, jump_from: int | None = None):
    """The Linen MLP's loss with an aux `load` standing for an MoE router's per-expert load,
    from which the sharded runs (mesh size > 1) differ from step `flip_from` on, as when a
    near-tied token's top-k choice flips there: the load moves by 0.25 and the loss jumps with
    it (a discontinuity), from step `jump_from` (default `flip_from`). Batches carry their
    step index in `step`."""
    model, base = linen_setup()
    jump_from = flip_from if jump_from is None else jump_from

    def loss_fn(params, b):
        loss = base(params, b)
        sharded = jax.sharding.get_abstract_mesh().size > 1  # traced under the step's mesh
        step = b["step"][0] + 1
        moved = jnp.float32(sharded) * (step >= flip_from)
        jumped = jnp.float32(sharded) * (step >= jump_from)
        logits = model.apply(params, b["x"])
        loss = loss + jumped * 1e-2 * jnp.mean(logits * logits)
        return loss, {"load": jnp.array([0.5, 0.5]) + moved * jnp.array([-0.25, 0.25])}

    batches = [dict(b, step=np.full((16,), i, np.int32)) for i, b in enumerate(classification_batches())]
    return model, loss_fn, batches


def test_a_routing_flip_stops_the_judging_at_its_step_and_is_reported():
    """Without `routing` the jump fails step 2; with it the load differs from step 2 on
    (exactly 0.25), steps 2-3 are reported (the jump's loss difference is there) and not judged,
    and step 1, judged, passes; the table and the JSON say so."""
    model, loss_fn, batches = routed_setup(flip_from=2)
    plain = run(model, loss_fn, batches=batches, strategies=("full_shard",), has_aux=True)
    assert not plain.passed and plain.strategies["full_shard"].first_divergence.step == 2
    r = run(model, loss_fn, batches=batches, strategies=("full_shard", "no_shard"), has_aux=True, routing="load")
    assert r.passed and r.routing == "load"
    for s in r.strategies.values():
        assert s.routing_flip_step == 2 and s.judged_steps == 1 and s.first_divergence is None
        assert s.routing_diff == [0.0, 0.25, 0.25]
        assert s.loss_rel_diff[0] <= r.tolerance.loss_rtol < s.loss_rel_diff[1]  # reported, not judged
    text = r.format()
    assert "PASS (steps 1-1)" in text and "steps 2-3 reported, not judged" in text
    assert "up to the routing flip of full_shard, no_shard" in text
    assert fj.VerifyReport.from_dict(json.loads(json.dumps(r.to_dict()))) == r


def test_routing_that_differs_from_the_same_params_fails_and_a_jump_before_the_flip_is_judged():
    """A load that differs at step 1, where both runs start from the same params, is not a
    flip rounding can explain: FAIL at step 1 naming the routing. A loss that jumps at step 1
    while the load differs only from step 2 fails at step 1 on the loss."""
    model, loss_fn, batches = routed_setup(flip_from=1)
    r = run(model, loss_fn, batches=batches, strategies=("full_shard",), has_aux=True, routing="load")
    d = r.strategies["full_shard"].first_divergence
    assert not r.passed and d.step == 1 and d.routing == 0.25 and r.strategies["full_shard"].judged_steps == 0
    assert "the routing differs from the reference's by 0.25 although both start from the same params" in r.format()
    model, loss_fn, batches = routed_setup(flip_from=2, jump_from=1)
    r = run(model, loss_fn, batches=batches, strategies=("full_shard",), has_aux=True, routing="load")
    d = r.strategies["full_shard"].first_divergence
    assert not r.passed and d.step == 1 and d.loss is not None and d.routing is None


def test_routing_option_bad_input_is_one_line():
    model, loss_fn, batches = routed_setup(flip_from=2)
    kw = dict(batches=batches, strategies=["full_shard"], devices=8, steps=1, min_shard_size=1, check_init=False)
    _raises(
        "routing=.load. names a key of the loss.s aux: it needs has_aux=True", model, SGD, loss_fn, **kw, routing="load"
    )
    _raises(r"routing='loads' is not a key of the loss's aux \(it has: load\)", model, SGD, loss_fn, **kw,
            has_aux=True, routing="loads")  # fmt: skip
    _raises("routing=3 must be the name", model, SGD, loss_fn, **kw, has_aux=True, routing=3)


# ----------------------------------------------------------------------------- tolerances


def test_tolerance_follows_the_optimizer_and_the_compute_dtype():
    p = {"w": jax.ShapeDtypeStruct((4, 4), jnp.float32)}
    assert optimizer_kind(optax.sgd(0.1), p) == "sgd"
    assert optimizer_kind(optax.chain(optax.clip(1.0), optax.sgd(0.1, momentum=0.9)), p) == "sgd"
    for opt in (optax.adamw(1e-3), optax.adafactor(1e-3), optax.lion(1e-4), optax.rmsprop(1e-3), optax.adagrad(1e-2)):
        assert optimizer_kind(opt, p) == "adaptive", opt
    assert default_tolerance(optax.adamw(1e-3), p, "bf16").name == "adaptive-bf16"
    assert default_tolerance(optax.sgd(0.1), p, None).name == "sgd-f32"
    t = TOLERANCES
    assert t["sgd-f32"].param_rtol < t["adaptive-f32"].param_rtol < t["adaptive-bf16"].param_rtol


def test_report_round_trips_through_json():
    r = local_mean_report()  # a failed report: a first divergence with its leaves
    back = fj.VerifyReport.from_dict(json.loads(json.dumps(r.to_dict())))
    assert back == r and not back.passed


# ----------------------------------------------------------------------------- bad input


def _raises(match, *args, **kw):
    with pytest.raises(VerifyError, match=match) as e:
        fj.verify(*args, **kw)
    assert "\n" not in str(e.value)


def test_bad_input_is_one_typed_line():
    model, loss_fn = linen_setup()
    b = classification_batches(1)[0]
    _raises("unknown strategy 'zero4'", model, SGD, loss_fn, b, strategies=["zero4"])
    _raises(
        "leading dim 12, which cannot split over devices=8", model, SGD, loss_fn, {"x": b["x"][:12], "y": b["y"][:12]}
    )
    _raises("x microbatches=4", model, SGD, loss_fn, b, microbatches=4)
    _raises("batches has 1 batches, fewer than steps=3", model, SGD, loss_fn, batches=[b])
    _raises("fewer than devices=64", model, SGD, loss_fn, b, devices=64)
    _raises("unknown option", model, SGD, loss_fn, b, clip=1.0)
    _raises("tolerance 'tight'", model, SGD, loss_fn, b, tolerance="tight")
    _raises("factory spec is 'module:function'", "no_colon", devices=8)
    _raises("cannot import it", "no_such_module_xyz:make", devices=8)

    def bad_init(rng):
        return {"w": jnp.ones((3, 4)) @ jnp.ones((5, 2))}

    _raises(
        "the model does not initialise: TypeError: dot_general requires contracting",
        bad_init,
        SGD,
        lambda p, b: jnp.sum(p["w"]),
        b,
    )

    def bad_loss(params, batch):
        return params["w1"] @ batch["y"]

    _raises("loss_fn fails on the batch", model, SGD, bad_loss, b)


# ----------------------------------------------------------------------------- child process + CLI


def _env():
    return dict(
        os.environ,
        PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]),
        JAX_PLATFORMS="cpu",
        FSDP_JAX_CACHE_DIR=str(ROOT / ".jax_cache"),
    )


@pytest.mark.slow
def test_factory_spec_runs_in_a_child_with_more_devices_than_this_process():
    # this process has 8 devices; 16 need the child process
    r = fj.verify(
        "test_verify:factory",
        devices=16,
        steps=2,
        strategies=["full_shard"],
        factory_kwargs={"center": "local"},
        check_init=False,
    )
    assert r.devices == 16 and r.strategies["full_shard"].mesh["fsdp"] == 16
    assert not r.passed and r.strategies["full_shard"].first_divergence.step == 1
    with pytest.raises(VerifyError, match="unknown strategy"):
        fj.verify("test_verify:factory", devices=16, strategies=["nope"])
    with pytest.raises(VerifyError, match="in_subprocess=True needs"):
        fj.verify(*linen_setup(), devices=8, in_subprocess=True)


@pytest.mark.parametrize("config, n", [("llama2_7b", 8), ("llama2_7b", 16), ("llama2_70b", 64), ("llama_1b", 8)])
def test_shrunk_dims_keep_their_divisibility_by_every_mesh_axis(config, n):
    import math

    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.verify_shrink import shrunk_model

    m = load_config(ROOT / "configs" / f"{config}.yaml").model
    small, changed = shrunk_model(m, n)
    for k in ("d_model", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size"):
        a, b = getattr(m, k), getattr(small, k)
        assert b <= a and math.gcd(a, n) == math.gcd(b, n), (k, a, b)
    assert small.n_heads // small.n_kv_heads == m.n_heads // m.n_kv_heads  # grouped-query ratio
    assert small.head_dim % 2 == 0 and small.n_layers == 2
    assert changed["model.d_model"] == (m.d_model, small.d_model) and small.d_model <= 1024


def _cli(*args):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "verify.py"), *args],
        capture_output=True,
        text=True,
        env=_env(),
        cwd=ROOT,
        timeout=900,
    )


@pytest.mark.slow
def test_cli_shrinks_a_7b_config_keeping_every_sharding_decision(capsys):
    """The command line end to end: a config too big for the CPU is shrunk keeping every
    sharding decision, two strategies (one by alias) pass, one JSON document."""
    rc, out, err = call(
        "verify",
        "--config",
        "configs/llama2_7b.yaml",
        "--strategies",
        "full_shard,ddp",
        "--steps",
        "2",
        "--json",
        capsys=capsys,
    )
    assert rc == 0, err[-3000:] + out
    doc = json.loads(out)
    assert doc["passed"] and set(doc["strategies"]) == {"full_shard", "no_shard"}
    assert doc["shrunk"]["model.n_layers"] == [32, 2] and doc["shrunk"]["model.d_model"][0] == 4096
    notes = "\n".join(doc["notes"])
    assert "shrunk to verify on CPU" in notes and "model.d_model 4096 -> " in notes
    assert "same sharding decision for every param under every strategy" in notes


@pytest.mark.parametrize(
    "args, match",
    [
        (["--config", "configs/nope.yaml"], "nope.yaml"),
        (["--config", "configs/tiny.yaml", "--strategies", "zero4"], "unknown strategy 'zero4'"),
        (["--config", "configs/tiny.yaml", "--devices", "0"], "--devices"),
        (["--config", "configs/tiny.yaml", "model.d_modle=64"], "model.d_modle"),
    ],
)
def test_cli_bad_input_exit_2_one_line(args, match, capsys):
    rc, out, err = call("verify", *args, capsys=capsys)
    one_line(rc, err, match)
    assert out == ""


@pytest.mark.slow
def test_cli_device_count_that_cannot_split_the_batch_exits_2():
    """3 CPU devices need a process of their own (JAX fixes the count when it starts)."""
    out = _cli("--config", "configs/tiny.yaml", "--devices", "3")
    one_line(out.returncode, out.stderr, "cannot split over devices=3")
    assert out.stdout == ""


@pytest.mark.slow
@pytest.mark.parametrize("bug, code", [("none", 0), ("local_mean", 1)])
def test_example_passes_healthy_and_fails_broken(bug, code, monkeypatch, capsys):
    """examples/verify_model.py's main() in this process (its 8 devices are this process's)."""
    monkeypatch.setattr(sys, "argv", ["verify_model.py", "--bug", bug])
    capsys.readouterr()
    rc = example("verify_model").main()
    out, err = capsys.readouterr()
    assert rc == code, err[-3000:]
    last = out.strip().splitlines()[-1]
    assert last.startswith("PASS" if code == 0 else "FAIL"), out
    if code:
        assert "first divergence at step 1: loss rel diff" in out
