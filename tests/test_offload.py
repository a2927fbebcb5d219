"""Host offload: optimizer state / master weights at rest in pinned_host memory, and the
offloading remat policies. Offloaded runs must match the non-offloaded run, the compiled
program must take the offloaded state from host memory, checkpoints must restore across
offload settings, and a backend without host memory must give one clear line."""

from pathlib import Path

import jax
import numpy as np
import optax
import pytest

import fsdp_jax as fj
from fsdp_jax.app.models import DecoderConfig
from fsdp_jax.sharding import offload as ol
from fsdp_jax.sharding import remat as remat_lib
from fsdp_jax.train.build import build
from helpers import call, max_abs_diff, script
from helpers import tiny_llama as _tiny_llama
from helpers import token_batches as _token_batches

ROOT = Path(__file__).resolve().parents[1]

# smaller than helpers.TINY: these tests compile many steps on a shared CPU
CFG = DecoderConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=64, max_seq_len=16)


def tiny_llama(remat="none"):
    return _tiny_llama(CFG, remat=remat)


def token_batches(n, batch=8):
    return _token_batches(n, batch=batch, seq=16, vocab=64)


OPTIMIZERS = {"sgd": lambda: optax.sgd(0.5, momentum=0.9), "adamw": lambda: optax.adamw(1e-3)}
STRATEGY_MESH = {
    "full_shard": dict(fsdp=8),
    "shard_grad_op": dict(fsdp=8),
    "shard_opt": dict(fsdp=8),
    "no_shard": dict(fsdp=8),
    "hybrid_shard": dict(data=2, fsdp=4),
}


def kinds(tree) -> set[str]:
    return {x.sharding.memory_kind for x in jax.tree.leaves(tree)}


@pytest.fixture(scope="module")
def built():
    """`build` of the tiny model, memoised per program: the tests that lower, place, evaluate or
    train the same program share one built object, so its jitted steps trace once."""
    cache = {}

    def get(offload, opt="adamw", strategy="full_shard", remat="none", **step_kw):
        key = (offload, opt, strategy, remat, tuple(sorted(step_kw.items())))
        if key not in cache:
            m, loss_fn = tiny_llama(remat=remat)
            mesh = fj.make_mesh(**STRATEGY_MESH[strategy])
            cache[key] = build(m, OPTIMIZERS[opt](), mesh, strategy, loss_fn=loss_fn, offload=offload, **step_kw)
        return cache[key]

    return get


@pytest.fixture(scope="module")
def runs(built):
    """(built, state, metrics) of `n` steps from key(0), memoised per program and step count: the
    non-offloaded baselines and the offloaded runs each train once for every test that checks them."""
    cache = {}

    def get(offload, opt="adamw", n=3, batch=8, **kw):
        key = (offload, opt, n, batch, tuple(sorted(kw.items())))
        if key not in cache:
            b = built(offload, opt, **kw)
            state = b.init_state(jax.random.key(0))
            metrics = []
            for x in token_batches(n, batch):
                state, mt = b.train_step(state, x)
                metrics.append({k: float(v) for k, v in mt.items()})
            cache[key] = b, state, metrics
        return cache[key]

    return get


def check_matches(offload, opt, runs, n):
    _, ref_state, ref_metrics = runs("none", opt, n=n)
    b, state, metrics = runs(offload, opt, n=n)
    assert max_abs_diff(state.params, ref_state.params) < 1e-6
    assert max_abs_diff(state.opt_state, ref_state.opt_state) < 1e-6
    np.testing.assert_allclose([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics], rtol=1e-6)
    assert metrics[-1]["loss"] < metrics[0]["loss"]  # it trains
    assert int(state.step) == n
    # where the state lives, after 10 donated steps
    assert kinds(state.opt_state) == {ol.HOST}
    assert kinds(state.params) == ({ol.HOST} if offload == "optimizer+params" else {"device"})
    assert kinds(state.step) == {"device"}
    assert kinds(ref_state.params) == kinds(ref_state.opt_state) == {"device"}
    # and the abstract state (AOT and checkpoint target) says the same
    assert {x.sharding.memory_kind for x in jax.tree.leaves(b.abstract_state.opt_state)} == {ol.HOST}


@pytest.mark.slow
@pytest.mark.parametrize("opt", list(OPTIMIZERS))
@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
def test_ten_steps_match_no_offload(offload, opt, runs):
    check_matches(offload, opt, runs, n=10)


@pytest.mark.slow
def test_grad_accumulation_and_clipping_hold(runs):
    kw = dict(microbatches=2, clip_norm=0.05, batch=16)
    _, ref_state, ref_metrics = runs("none", "adamw", **kw)
    _, state, metrics = runs("optimizer+params", "adamw", **kw)
    assert all(m["grad_norm"] > 0.05 for m in metrics)  # clipping was active on every step
    assert max_abs_diff(state.params, ref_state.params) < 1e-6
    np.testing.assert_allclose([m["grad_norm"] for m in metrics], [m["grad_norm"] for m in ref_metrics], rtol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", list(STRATEGY_MESH))
def test_every_strategy(strategy, runs):
    n = 10 if strategy == "full_shard" else 3  # full_shard's two runs are test_ten_steps_match_no_offload's
    _, ref_state, _ = runs("none", "sgd", strategy=strategy, n=n)
    _, state, _ = runs("optimizer+params", "sgd", strategy=strategy, n=n)
    assert max_abs_diff(state.params, ref_state.params) < 1e-6
    assert kinds(state.params) == kinds(state.opt_state) == {ol.HOST}


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
def test_compiled_device_argument_bytes_drop_by_offloaded_state(offload, built):
    batch = token_batches(1)[0]
    args = {}
    for o in ("none", offload):
        b = built(o, "adamw")  # adamw(1e-3) on fsdp=8, full_shard
        compiled = b.train_step.lower(b.abstract_state, batch).compile()
        args[o] = ol.entry_argument_bytes(compiled.as_text())
        ma = compiled.memory_analysis()
        if getattr(ma, "host_argument_size_in_bytes", 0):  # backends that report host bytes
            assert ma.host_argument_size_in_bytes == args[o]["host"]
    abstract = b.abstract_state
    # the offloaded state's per-device bytes, from the shardings alone
    expected = sum(
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for part in ((abstract.params, abstract.opt_state) if offload == "optimizer+params" else (abstract.opt_state,))
        for x in jax.tree.leaves(part)
    )
    assert expected > 0
    assert args["none"]["host"] == 0
    assert args[offload]["host"] == expected
    assert args["none"]["device"] - args[offload]["device"] == expected
    assert ol.offloaded_bytes(abstract)["host"] == expected


def remat_loss_and_grads(name, params=None):
    """(loss, grads) of the tiny model under remat policy `name` on one batch, whether its
    jaxpr sends residuals to host memory, and the params (key(0); given: `none`'s, the policy
    does not change the init). One trace gives both the jaxpr and the compiled program."""
    batch = token_batches(1)[0]
    m, loss_fn = tiny_llama(remat=name)
    p = jax.jit(m.init)(jax.random.key(0)) if params is None else params
    traced = jax.jit(jax.value_and_grad(loss_fn)).trace(p, batch)
    return traced.lower().compile()(p, batch), "<host>" in str(traced.jaxpr), p


@pytest.fixture(scope="module")
def remat_none():
    """`remat_loss_and_grads("none")`, once for every offloading policy's case."""
    return remat_loss_and_grads("none")


@pytest.mark.slow
@pytest.mark.parametrize("policy", sorted(remat_lib.offloading()))
def test_offloading_remat_same_loss_and_grads_as_none(policy, remat_none):
    out = {}
    for name, (out[name], host, _) in (("none", remat_none), (policy, remat_loss_and_grads(policy, remat_none[2]))):
        # the policy really sends residuals to host memory (and `none` does not)
        assert host == (name != "none")
    assert abs(float(out[policy][0]) - float(out["none"][0])) < 1e-6
    assert max_abs_diff(out[policy][1], out["none"][1]) < 1e-6


@pytest.mark.slow
def test_offloading_remat_in_the_sharded_step_with_offloaded_state(runs):
    # 10 steps: the baseline is test_ten_steps_match_no_offload's sgd run
    _, ref_state, ref_metrics = runs("none", "sgd", n=10)
    _, state, metrics = runs("optimizer", "sgd", n=10, remat="offload_attn_mlp_out")
    np.testing.assert_allclose([m["loss"] for m in metrics], [m["loss"] for m in ref_metrics], rtol=1e-6)
    assert max_abs_diff(state.params, ref_state.params) < 1e-6


def test_eval_step_and_placement_with_offloaded_params(built):
    m, _ = tiny_llama()
    batch = token_batches(1)[0]
    params = jax.jit(m.init)(jax.random.key(0))
    losses = {}
    for o in ("none", "optimizer+params"):
        b = built(o, "adamw")  # adamw(1e-3) on fsdp=8, full_shard
        st = b.place(params)
        assert kinds(st.params) == ({ol.HOST} if o != "none" else {"device"})
        losses[o] = float(b.eval_step(st.params, batch)["loss"])
    assert losses["none"] == losses["optimizer+params"]


@pytest.mark.slow
def test_checkpoints_restore_across_offload_settings(tmp_path, built):
    from fsdp_jax.checkpoint import Checkpointer

    batches = token_batches(3)
    B = {o: built(o, "adamw") for o in ol.OFFLOADS}  # the ten-step tests' programs: adamw(1e-3), fsdp=8
    # reference: three steps without offload
    ref = B["none"].init_state(jax.random.key(0))
    for x in batches:
        ref, _ = B["none"].train_step(ref, x)
    # offloaded -> saved -> resumed without offload -> saved -> resumed offloaded (optimizer only)
    st, _ = B["optimizer+params"].train_step(B["optimizer+params"].init_state(jax.random.key(0)), batches[0])
    with Checkpointer(tmp_path / "a") as c:
        c.save(1, st)
        c.wait()
        st = c.restore(B["none"].abstract_state).state
    assert kinds(st.params) == kinds(st.opt_state) == {"device"}
    st, _ = B["none"].train_step(st, batches[1])
    with Checkpointer(tmp_path / "b") as c:
        c.save(2, st)
        c.wait()
        st = c.restore(B["optimizer"].abstract_state).state
    assert kinds(st.opt_state) == {ol.HOST} and kinds(st.params) == {"device"}
    st, _ = B["optimizer"].train_step(st, batches[2])
    assert int(st.step) == 3
    assert max_abs_diff(st.params, ref.params) < 1e-6
    assert max_abs_diff(st.opt_state, ref.opt_state) < 1e-6


# ---- bad input -----------------------------------------------------------------------


def test_unknown_offload_name_lists_choices():
    with pytest.raises(ol.OffloadError, match=r"'gpu'.*none, optimizer, optimizer\+params"):
        ol.get_offload("gpu")
    m, _ = tiny_llama()
    with pytest.raises(ol.OffloadError, match="offload"):
        build(m, optax.sgd(0.1), fj.make_mesh(fsdp=8), offload="params")


@pytest.mark.parametrize("offload", ["optimizer", "optimizer+params"])
def test_no_host_memory_kinds_gives_one_clear_line(offload, monkeypatch):
    monkeypatch.setattr(ol, "host_memory_available", lambda devices: False)
    m, _ = tiny_llama()
    with pytest.raises(ol.OffloadError) as e:
        build(m, optax.sgd(0.1), fj.make_mesh(fsdp=8), offload=offload)
    msg = str(e.value)
    assert "\n" not in msg and offload in msg and "pinned_host" in msg and "offload: none" in msg
    # "none" needs nothing from the backend
    build(m, optax.sgd(0.1), fj.make_mesh(fsdp=8), offload="none")


def test_probe_rejects_devices_without_pinned_host():
    class NoHost:
        platform = "fake"

        def addressable_memories(self):
            return []

    class Old:  # a device from a jax without memories
        platform = "fake"

    assert ol.host_memory_available(jax.devices())  # CPU has pinned_host
    assert not ol.host_memory_available([NoHost()])
    assert not ol.host_memory_available([Old()])
    with pytest.raises(ol.OffloadError, match="fake"):
        ol.check_supported("optimizer", [NoHost()])


@pytest.mark.parametrize("override,key", [("offload=optimizer", "offload"), ("remat=offload_attn_mlp_out", "remat")])
def test_trainer_config_without_host_memory_is_bad_input(override, key, monkeypatch, capsys):
    from fsdp_jax.app.config.parse import config_from_dict
    from fsdp_jax.app.exits import BAD_INPUT, fail
    from fsdp_jax.app.trainer.setup import check_offload
    from fsdp_jax.errors import ConfigError

    k, v = override.split("=")
    cfg = config_from_dict({k: v})
    check_offload(cfg)  # fine on CPU
    monkeypatch.setattr(ol, "host_memory_available", lambda devices: False)
    with pytest.raises(ConfigError) as e:
        check_offload(cfg)
    assert e.value.key == key and isinstance(e.value, BAD_INPUT)
    assert fail(e.value) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and v in err and "pinned_host" in err


@pytest.mark.parametrize("value", ["gpu", "params", "", "Optimizer+Params+Activations"])
def test_config_rejects_unknown_offload(value):
    from fsdp_jax.app.config.parse import config_from_dict
    from fsdp_jax.errors import ConfigError

    with pytest.raises(ConfigError, match=r"offload.*allowed: none, optimizer, optimizer\+params"):
        config_from_dict({"offload": value})


# ---- planner -------------------------------------------------------------------------


# The trainer's config of the tiny model: the planner test plans it, the bench-offload test
# benchmarks it (the same train steps: the compilation cache answers the second one's)
PLAN_CONFIG = {
    "model": {
        k: getattr(CFG, k)
        for k in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "ffn_dim", "max_seq_len")
    },
    "data": {"seq_len": 16},
    "remat": "none",
    "train": {"global_batch": 8},
}


@pytest.mark.slow
def test_planner_host_bytes_analytic_equal_compiled(built):
    """The planner's analytic host bytes (from the sharding plan) equal the compiled
    program's host-resident argument bytes (from its parameter layouts)."""
    from fsdp_jax.app.config.parse import config_from_dict
    from fsdp_jax.app.planner.one_strategy import plan_strategy

    out = {}
    for o in ("none", "optimizer+params", "optimizer+params:streamed"):
        cfg = config_from_dict({**PLAN_CONFIG, "offload": o})
        out[o] = plan_strategy(cfg, "full_shard", jax.devices()[:8])
    a, c = out["optimizer+params"]["analytic"], out["optimizer+params"]["compiled"]
    assert a["host"] > 0 and a["host"] == c["host_argument"]
    assert c["device_argument"] == a["params"] + a["optimizer"] + a["batch"] - a["host"]
    assert out["none"]["compiled"]["host_argument"] == out["none"]["analytic"]["host"] == 0
    # per step: params in twice (forward, update) and out once, optimizer state in and out
    opt = a["optimizer"] - 4  # less the replicated int32 step counter, which stays on the device
    assert a["transfer_per_step"] == 3 * a["params"] + 2 * opt
    assert a["device_total"] < out["none"]["analytic"]["device_total"]
    # streamed: the stacked params come per layer (forward, and the backward's recompute),
    # their grads go to host and come back; on the device, two layers of their compute copy instead of all of it, and two layers of
    # params + optimizer state during the update instead of the largest leaf's
    s = out["optimizer+params:streamed"]["analytic"]
    b = built("none", "adamw")  # adamw(1e-3) on fsdp=8, full_shard
    shard = [
        int(np.prod(x.sharding.shard_shape(x.shape))) * x.dtype.itemsize
        for x in jax.tree.leaves(b.abstract_state.params)
    ]
    flags = jax.tree.leaves(b.plan.layered)
    stacked = sum(n for n, f in zip(shard, flags) if f)
    # in: the backward's refetch and the grads' return; out: the grads
    assert s["transfer_per_step"] == a["transfer_per_step"] + 3 * stacked
    two = 2 * stacked // CFG.n_layers  # two layers of the stacked params (f32: also their compute copy)
    ratio = 1 + opt / a["params"]  # params + optimizer state of a leaf, for the update
    want = (stacked - two) + (max(shard) - two) * ratio
    assert abs((a["device_total"] - s["device_total"]) - want) <= 2, (a["device_total"], s["device_total"], want)


def test_plan_script_rejects_bad_offload(capsys):
    for bad in ("gpu", "none,params", ""):
        rc, _, err = call(
            "plan", "--config", ROOT / "configs" / "tiny.yaml", "--devices", "8", "--offload", bad, capsys=capsys
        )
        assert rc == 2 and err.count("\n") == 1 and "--offload" in err and "optimizer+params" in err


# ---- the trainer -----------------------------------------------------------------------


@pytest.mark.slow
def test_trainer_offloaded_run_resumes_without_offload(corpus, tmp_path):
    """scripts/train.py's loop with offload=optimizer+params (eval and sampling
    included), then the same run resumed with offload=none from its checkpoint."""
    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.trainer.loop import train

    base = [
        "model.d_model=32",
        "model.n_layers=2",
        "model.n_heads=2",
        "model.n_kv_heads=1",
        "model.ffn_dim=64",
        "model.max_seq_len=16",
        "data.seq_len=16",
        "train.global_batch=8",
        "train.eval_every=2",
        "train.eval_batches=1",
        "train.sample_tokens=4",
        "train.log_every=1",
        "train.checkpoint_every=2",
        "data.source=none",
        f"data.path={corpus}",
        f"run_dir={tmp_path / 'run'}",
    ]

    def go(offload, steps):
        cfg = load_config(ROOT / "configs" / "tiny.yaml", base + [f"offload={offload}", f"train.steps={steps}"])
        return train(cfg, progress=False)

    first = go("optimizer+params", 2)
    assert kinds(first["run"].state.params) == {ol.HOST} and "sample" in first
    resumed = go("none", 4)
    assert resumed["run"].start_step == 2 and resumed["final_step"] == 4
    assert kinds(resumed["run"].state.opt_state) == {"device"}
    assert np.isfinite(resumed["val_loss"])


@pytest.mark.parametrize(
    "args,needle", [(["--rounds", "0"], "--rounds"), (["offload=gpu"], "offload"), (["--strategy", "zero9"], "zero9")]
)
def test_bench_offload_bad_input_exits_2(args, needle, capsys):
    assert script("bench_offload").main(["--config", str(ROOT / "configs" / "tiny.yaml"), *args]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and needle in err


@pytest.mark.slow
def test_bench_offload_json(capsys, tmp_path):
    import json

    config = tmp_path / "tiny.yaml"  # JSON is YAML
    config.write_text(json.dumps(PLAN_CONFIG))
    assert script("bench_offload").main(["--config", str(config), "--rounds", "1", "--steps", "1", "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    r = doc["results"]
    assert set(r) == set(ol.OFFLOADS) and r["none"]["ratio_to_none"] == 1.0
    assert (
        r["none"]["to_device_bytes"] == 0 < r["optimizer"]["to_device_bytes"] < r["optimizer+params"]["to_device_bytes"]
    )
