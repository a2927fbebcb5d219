"""Memory planner and sharding inspector: the compiled figures are the trainer's own step,
the analytic figures hold against them, the warnings fire on real mistakes, and the
scripts keep the CLI contracts (one JSON document; exit 2 with one line on bad input)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import optax
import pytest

import fsdp_jax as fj
import fsdp_jax.app.models.decoder as llama
from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.data import corpus as data_lib
from fsdp_jax.app.data.windows import make_dataset
from fsdp_jax.app.models.decoder import count_params
from fsdp_jax.app.planner import estimate as pl
from fsdp_jax.app.planner.flag_values import STRATEGY_ORDER, parse_bytes
from fsdp_jax.app.planner.inspection import inspect_compiled
from fsdp_jax.app.planner.report import format_table, sharding_warnings
from fsdp_jax.app.trainer import loop as train_lib
from fsdp_jax.errors import PlanError
from fsdp_jax.hlo.memory import collective_report, compiled_memory
from helpers import TINY, TINY_MODEL_OVERRIDES, call, one_line, tiny_llama

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
# configs/tiny.yaml shrunk to compile in seconds
SMALL = [*TINY_MODEL_OVERRIDES, "train.steps=10"]
KEYS_ANALYTIC = {"params", "grads", "optimizer", "gathered", "activations", "total"}
KEYS_COMPILED = {"argument", "output", "alias", "temp", "peak"}


def run_script(name, *args):
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / name), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ),
    )


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    out = tmp_path_factory.mktemp("corpus") / "bytes"
    data_lib.prepare_text([ROOT / "fsdp_jax" / "app" / "planner"], out, val_fraction=0.1, pattern="*.py")
    return out


@pytest.fixture(scope="module")
def overrides(corpus, tmp_path_factory):
    return SMALL + [f"data.path={corpus}", "data.source=none", f"run_dir={tmp_path_factory.mktemp('run')}"]


@pytest.fixture(scope="module")
def cfg(overrides):
    return load_config(TINY_YAML, overrides)


@pytest.fixture(scope="module")
def doc(cfg):
    return pl.plan_config(cfg, 8, "all", device_memory=parse_bytes("1GB"), config_name="tiny")


@pytest.mark.slow
def test_compiled_figures_are_the_trainers_step(cfg, doc):
    run = train_lib.setup(cfg)  # the trainer's own build: real sharded init, real first batch
    local = make_dataset(cfg.data.path, "train", cfg.data.seq_len, cfg.train.global_batch, cfg.data.seed).batch(0)
    compiled = run.train_step.lower(run.state, train_lib.global_batch(run.plan, local)).compile()
    mem = compiled_memory(compiled)
    got = doc["strategies"][cfg.mesh.strategy]["compiled"]
    assert {k: got[k] for k in KEYS_COMPILED} == {k: mem[k] for k in KEYS_COMPILED}
    assert got["temp"] > 0 and got["peak"] >= got["argument"] + got["temp"] - got["alias"]


# analytic total / compiled peak, measured on jax 0.10.2 for this config (SMALL, 8 devices)
# (re-measured after the non-finite guard became a per-leaf select: XLA:CPU does not fuse
# that select into the in-place update as XLA:GPU does (tests/test_targets.py), so every
# CPU peak rose by ~3%, and no_shard's now exceeds the formula, which assumes in place;
# shard_grad_op's formula gained the layer its backward loop slices out of the kept stack,
# measured on the GPU-target compile (issue 26): 1.140 -> 1.247 here)
TOTAL_OVER_PEAK = {
    "no_shard": 0.973,
    "shard_opt": 1.037,
    "shard_grad_op": 1.247,
    "full_shard": 1.394,
    "hybrid_shard": 1.394,
}


@pytest.mark.slow
def test_analytic_agrees_with_compiled_and_the_textbook(doc, cfg):
    s = doc["strategies"]
    assert list(s) == list(STRATEGY_ORDER)
    n = count_params(cfg.model)
    assert doc["params"] == n and doc["devices"] == 8
    for name, r in s.items():
        a, c = r["analytic"], r["compiled"]
        assert KEYS_ANALYTIC <= set(a) and KEYS_COMPILED <= set(c), name
        assert all(isinstance(v, int) for v in [*a.values(), *c.values()]), name
        # params + optimizer state + batch are exact: the compiled step's arguments, to the byte
        assert c["argument"] == a["params"] + a["optimizer"] + a["batch"], name
        assert r["fits"] is True and r["headroom"] == 10**9 - c["peak"], name
        # the estimate's ratio to the compiled peak is pinned at what was measured (CPU, f32
        # compute; TOTAL_OVER_PEAK): a change to the formulas or to what XLA allocates shows
        # as a move of more than 5%; for the sharded strategies it is an upper bound
        ratio = a["total"] / c["peak"]
        assert ratio == pytest.approx(TOTAL_OVER_PEAK[name], rel=0.05), (name, ratio)
        assert ratio >= 1.0 or name == "no_shard", (name, ratio)
    # fp32 params + fp32 grads + AdamW mu, nu: 16 bytes per parameter without sharding
    assert s["no_shard"]["bytes_per_param"] == pytest.approx(16, rel=0.01)
    assert s["shard_opt"]["bytes_per_param"] == pytest.approx(4 + 4 + 8 / 8, rel=0.02)
    assert s["full_shard"]["bytes_per_param"] == pytest.approx(16 / 8, rel=0.05)  # + replicated norms
    # the trainer's mesh for every strategy (configs/tiny.yaml: data=1), hybrid_shard included
    assert all(r["mesh"] == {"data": 1, "fsdp": 8, "context": 1, "tensor": 1} for r in s.values())
    assert any("hybrid_shard uses data=1 x fsdp=8" in note for note in doc["notes"])
    # the reference model gathers per layer inside the loop and never reshards with all-to-all
    for name, r in s.items():
        assert not [w for w in r["warnings"] if "all-to-all" in w or "hoisted" in w], name
        assert "all-to-all" not in r["collectives_per_step"], name
    assert "all-gather" not in s["no_shard"]["collectives_per_step"]
    table = format_table(doc)
    for name in STRATEGY_ORDER:
        assert name in table
    assert "DDP" in table and "ZeRO-1" in table and "ZeRO-2" in table and "FSDP/ZeRO-3" in table


@pytest.mark.slow
def test_plans_more_devices_than_this_process_in_a_child(cfg):
    assert len(jax.devices()) == 8
    r = pl.run_strategies(cfg, 16, ["full_shard"])["full_shard"]
    assert r["mesh"] == {"data": 1, "fsdp": 16, "context": 1, "tensor": 1}
    state = r["analytic"]["params"] + r["analytic"]["optimizer"] + r["analytic"]["batch"]
    assert abs(r["compiled"]["argument"] - state) <= 0.02 * state


@pytest.mark.slow
def test_plan_script_json_and_plot(overrides, tmp_path, capsys):
    png = tmp_path / "plan.png"
    rc, out, err = call(
        "plan",
        "--config",
        TINY_YAML,
        "--devices",
        8,
        "--json",
        "--device-memory",
        "80GiB",
        "--plot",
        png,
        *overrides,
        capsys=capsys,
    )
    assert rc == 0, err
    d = json.loads(out)
    assert d["devices"] == 8 and d["device_memory"] == 80 * 2**30
    assert set(d["strategies"]) == set(STRATEGY_ORDER)
    for r in d["strategies"].values():
        assert KEYS_ANALYTIC <= set(r["analytic"]) and KEYS_COMPILED <= set(r["compiled"])
        assert r["fits"] is True
    assert png.stat().st_size > 10_000


def _compile(loss_fn, init, logical_axes, strategy="full_shard", rules=None):
    mesh = fj.make_mesh(fsdp=8)
    opt = optax.sgd(0.1)
    abstract = jax.eval_shape(init, jax.random.key(0))
    plan = fj.make_plan(abstract, opt, mesh, strategy, logical_axes, rules=rules, max_replicated_fraction=None)
    state = fj.abstract_state(plan, abstract, opt)
    batch = jax.ShapeDtypeStruct((16, 33), jnp.int32, sharding=plan.batch)
    compiled = fj.make_train_step(loss_fn, opt, plan).lower(state, batch).compile()
    return plan, compiled


def test_inspector_flags_a_replicated_parameter():
    def init(rng):
        k = jax.random.split(rng, 3)
        return {
            "w_in": jax.random.normal(k[0], (256, 512)) * 0.02,
            "w_out": jax.random.normal(k[1], (512, 256)) * 0.02,
            "table": jax.random.normal(k[2], (1024, 512)) * 0.02,
        }  # 2 MiB, deliberately replicated

    axes = {"w_in": ("embed", "mlp"), "w_out": ("mlp", "embed"), "table": ("norm", "norm")}

    def loss_fn(p, tok):
        x = jax.nn.one_hot(tok[:, :-1], 256)  # (B, S, 256)
        y = jnp.tanh(x @ p["w_in"]) @ p["w_out"]
        return jnp.mean((y - x) ** 2) + 1e-3 * jnp.mean(p["table"] ** 2)

    plan, compiled = _compile(loss_fn, init, axes)
    out = inspect_compiled(plan, compiled, logical_axes=axes)
    flagged = [w for w in out["warnings"] if w.startswith("replicated parameter")]
    assert len(flagged) == 1 and "table" in flagged[0] and "(1024, 512)" in flagged[0]
    assert {r["path"]: r["spec"] for r in out["rows"]}["table"] == "P(None, None)"


@pytest.mark.slow
def test_inspector_flags_activations_without_constraints(monkeypatch):
    monkeypatch.setattr(llama, "constrain", lambda x, names: x)  # a model that states no activation layout
    m, loss_fn = tiny_llama(TINY)
    plan, compiled = _compile(loss_fn, m.init, m.logical_axes)
    out = inspect_compiled(plan, compiled, logical_axes=m.logical_axes)
    assert out["collectives"]["per_step"]["all-to-all"]["count"] >= 1
    assert any(w.startswith("activations resharded with all-to-all") for w in out["warnings"])


def test_warnings_for_hoisted_gathers_and_an_underestimate():
    rows = [
        {
            "path": "w",
            "shape": [64, 64],
            "dtype": "float32",
            "spec": "P(fsdp, None)",
            "bytes_per_device": 2048,
            "total_bytes": 16384,
            "reason": "logical: embed->fsdp",
        }
    ]
    report = {
        "inside_loop": {},
        "outside_loop": {"all-gather": {"count": 9, "bytes": 50 << 20}},
        "per_step": {"all-gather": {"count": 9, "bytes": 50 << 20}},
        "loops": [{"body": "b", "parent": "main", "trip_count": 4, "op_name": "while"}],
    }
    w = sharding_warnings(
        rows,
        report,
        "full_shard",
        {"data": 1, "fsdp": 8, "context": 1, "tensor": 1},
        analytic_total=100,
        compiled_peak=120,
        layer_gather_bytes=1 << 20,
    )
    assert any(x.startswith("parameter all-gathers hoisted") for x in w)
    assert any("exceeds the analytic estimate" in x for x in w)
    ok = sharding_warnings(
        rows,
        report,
        "shard_grad_op",
        {"data": 1, "fsdp": 8, "context": 1, "tensor": 1},
        analytic_total=100,
        compiled_peak=105,
        layer_gather_bytes=1 << 20,
    )
    assert ok == []  # ZeRO-2 gathers outside the loop by design


def test_collective_report_multiplies_loop_bytes_by_trip_count():
    hlo = """HloModule m

%body (p: (s32[], f32[8])) -> (s32[], f32[8]) {
  %p = (s32[], f32[8]{0}) parameter(0)
  %x = f32[8]{0} get-tuple-element(%p), index=1
  %ag = f32[64]{0} all-gather(%x), dimensions={0}, metadata={op_name="jit(step)/while/body/dot"}
  ROOT %t = (s32[], f32[8]{0}) tuple(%i, %x)
}

%cond (p: (s32[], f32[8])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: f32[8]) -> f32[8] {
  %a = f32[8]{0} parameter(0)
  %w = (s32[], f32[8]{0}) while(%t0), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"5"}}
  %ar = f32[8]{0} all-reduce(%a), to_apply=%add
  ROOT %r = f32[8]{0} get-tuple-element(%w), index=1
}
"""
    rep = collective_report(hlo)
    ag = rep["inside_loop"]["all-gather"]
    assert (ag["count"], ag["bytes"], ag["runs"], ag["bytes_per_step"]) == (1, 256, 5, 1280)
    assert rep["outside_loop"]["all-reduce"]["bytes_per_step"] == 32
    assert rep["per_step"] == {"all-gather": {"count": 5, "bytes": 1280}, "all-reduce": {"count": 1, "bytes": 32}}
    assert rep["loops"][0]["trip_count"] == 5


@pytest.mark.slow
def test_inspect_script_json(overrides):
    p = run_script("inspect.py", "--config", TINY_YAML, "--devices", 8, "--strategy", "zero3", "--json", *overrides)
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert d["strategy"] == "full_shard"
    rows = {r["path"]: r for r in d["rows"]}
    assert rows["blocks/mlp/w_gate"]["spec"] == "P(None, fsdp, None)"
    assert rows["blocks/mlp/w_gate"]["reason"].startswith("logical: embed->fsdp")
    ag = d["collectives"]["inside_loop"]["all-gather"]
    assert ag["runs"] == 2 * ag["count"]  # 2 layers: each in-loop gather runs once per layer
    assert ag["bytes_per_step"] == 2 * ag["bytes"]
    # the scans (JAX while loops): forward and backward, 2 layers each. XLA's own loops (a
    # scatter-add expanded into a while by XLA:CPU's older emitters) carry their op's name.
    scans = [lp["trip_count"] for lp in d["collectives"]["loops"] if lp["op_name"].endswith("/while")]
    assert scans == [2, 2]
    assert d["warnings"] == []


@pytest.mark.parametrize(
    "script,args,needle",
    [
        ("plan.py", ["--config", "configs/nope.yaml", "--devices", "8"], "nope.yaml"),
        ("plan.py", ["--config", TINY_YAML, "--devices", "eight"], "--devices"),
        ("plan.py", ["--config", TINY_YAML, "--devices", "0"], "--devices"),
        ("plan.py", ["--config", TINY_YAML, "--devices", "8", "--device-memory", "lots"], "--device-memory"),
        ("plan.py", ["--config", TINY_YAML, "--devices", "8", "--strategies", "zero9"], "zero9"),
        ("inspect.py", ["--config", TINY_YAML, "--devices", "8", "--strategy", "zero4"], "zero4"),
        ("inspect.py", ["--config", "configs/nope.yaml", "--devices", "8"], "nope.yaml"),
    ],
)
def test_bad_input_exits_2_with_one_line(script, args, needle, capsys):
    rc, out, err = call(script, *args, capsys=capsys)
    one_line(rc, err, needle)
    assert out == ""


@pytest.mark.slow
def test_device_count_that_cannot_split_the_batch_exits_2():
    """Found after JAX is set up with 7 devices, so in a process of its own."""
    p = run_script("plan.py", "--config", TINY_YAML, "--devices", "7")
    one_line(p.returncode, p.stderr, "global_batch")
    assert p.stdout == ""


def test_parse_bytes():
    assert parse_bytes("80GB") == 80 * 10**9
    assert parse_bytes("80GiB") == 80 * 2**30
    assert parse_bytes("141 GB") == 141 * 10**9
    assert parse_bytes("1.5TB") == 1_500_000_000_000
    assert parse_bytes("4096") == 4096
    for bad in ("lots", "-1GB", "0", "80XB"):
        with pytest.raises(PlanError):
            parse_bytes(bad)
