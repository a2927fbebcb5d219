"""Compiled facts: per-device bytes from memory_analysis() and where the
collectives sit in the HLO."""

import dataclasses

import jax
import optax
import pytest

import fsdp_jax as fj
from fsdp_jax.hlo.memory import collective_report, compiled_memory, shard_bytes, state_bytes_per_device, tree_bytes
from helpers import TINY, TINY_MODEL_OVERRIDES, tiny_llama

# wider than TINY so the replicated norm scales stay well under 1% of the state
MEM_CFG = dataclasses.replace(TINY, d_model=128, ffn_dim=384)

MESHES = {
    "full_shard": dict(fsdp=8),
    "shard_grad_op": dict(fsdp=8),
    "shard_opt": dict(fsdp=8),
    "no_shard": dict(fsdp=8),
    "hybrid_shard": dict(data=2, fsdp=4),
}


def compile_step(strategy, optimizer, mesh_kw=None, remat="none", microbatches=1, cfg=TINY):
    m, loss_fn = tiny_llama(cfg, remat=remat)
    mesh = fj.make_mesh(**(mesh_kw or MESHES[strategy]))
    plan = fj.make_plan(jax.eval_shape(m.init, jax.random.key(0)), optimizer, mesh, strategy, m.logical_axes)
    abstract = fj.abstract_state(plan, m.abstract_params, optimizer)
    batch = jax.ShapeDtypeStruct((16, 33), "int32", sharding=plan.batch)
    step = fj.make_train_step(loss_fn, optimizer, plan, microbatches=microbatches)
    return step.lower(abstract, batch).compile(), abstract, batch, m


@pytest.fixture(scope="module")
def compiled_adamw():
    return {s: compile_step(s, optax.adamw(1e-3), cfg=MEM_CFG) for s in MESHES}


@pytest.mark.slow
def test_argument_bytes_equal_the_analytic_formula(compiled_adamw):
    for s, (compiled, abstract, batch, m) in compiled_adamw.items():
        mem = compiled_memory(compiled)
        analytic = state_bytes_per_device(abstract)["total"] + shard_bytes(batch)
        assert mem["argument"] == analytic, s
        assert mem["alias"] >= state_bytes_per_device(abstract)["total"] - 4, s  # state donated


@pytest.mark.slow
def test_full_shard_holds_one_eighth(compiled_adamw):
    full = compiled_adamw["full_shard"]
    none = compiled_adamw["no_shard"]
    batch_b = shard_bytes(full[2])
    full_state = compiled_memory(full[0])["argument"] - batch_b
    none_state = compiled_memory(none[0])["argument"] - batch_b
    assert abs(full_state - none_state / 8) <= 0.01 * none_state / 8 + batch_b


@pytest.mark.slow
def test_each_strategy_matches_the_textbook_split(compiled_adamw):
    m = compiled_adamw["no_shard"][3]
    p = tree_bytes(m.abstract_params)  # fp32 params, total
    norms = tree_bytes(
        [v for k, v in jax.tree_util.tree_flatten_with_path(m.abstract_params)[0] if "norm" in jax.tree_util.keystr(k)]
    )  # replicated by the rules (norm -> None)
    expect = {  # (params, optimizer state = Adam mu + nu) per device, before the replicated norm scales
        "full_shard": ((p - norms) / 8, 2 * (p - norms) / 8),
        "shard_grad_op": ((p - norms) / 8, 2 * (p - norms) / 8),
        "shard_opt": (p - norms, 2 * (p - norms) / 8),
        "no_shard": (p - norms, 2 * (p - norms)),
        "hybrid_shard": ((p - norms) / 4, 2 * (p - norms) / 4),
    }
    for s, (compiled, abstract, batch, _) in compiled_adamw.items():
        got = state_bytes_per_device(abstract)
        assert got["params"] == expect[s][0] + norms, s
        assert got["opt_state"] == expect[s][1] + 2 * norms + 4, s  # + int32 Adam count


def _gathers(report, where):
    return report[where].get("all-gather", {"count": 0, "op_names": []})


def test_full_shard_gathers_each_layer_inside_the_loop_forward_and_backward():
    compiled, *_ = compile_step("full_shard", optax.sgd(0.1), remat="full")
    rep = collective_report(compiled.as_text())
    inside = _gathers(rep, "inside_loop")
    fwd = [n for n in inside["op_names"] if "transpose(" not in n]
    bwd = [n for n in inside["op_names"] if "transpose(" in n]
    # 7 stacked weights per layer (wq wk wv wo w_gate w_up w_down): each gathered in the
    # forward loop and again in the backward loop
    assert len(fwd) >= 7 and len(bwd) >= 7
    assert "all-to-all" not in rep["inside_loop"] and "all-to-all" not in rep["outside_loop"]
    outside = _gathers(rep, "outside_loop")
    assert outside["count"] <= 2  # only the embedding table and output head (not in the loop)


@pytest.mark.slow
def test_no_shard_has_no_parameter_all_gather():
    compiled, *_ = compile_step("no_shard", optax.sgd(0.1))
    rep = collective_report(compiled.as_text())
    assert "all-gather" not in rep["inside_loop"] and "all-gather" not in rep["outside_loop"]
    assert rep["outside_loop"]["all-reduce"]["count"] >= 1  # DDP gradient all-reduce


@pytest.mark.slow
def test_shard_grad_op_gathers_each_layer_once_in_the_forward_loop():
    """ZeRO-2 (fsdp_jax.train.layer_gather): the forward loop gathers each layer's 7 matrices and
    the backward reuses them even under remat full (ZeRO-3 re-gathers: 14 in loops)."""
    compiled, *_ = compile_step("shard_grad_op", optax.sgd(0.1), remat="full")
    rep = collective_report(compiled.as_text())
    assert rep["inside_loop"]["all-gather"]["count"] == 7
    assert rep["inside_loop"]["all-gather"]["bytes_per_step"] == 2 * rep["inside_loop"]["all-gather"]["bytes"]
    z3 = collective_report(compile_step("full_shard", optax.sgd(0.1), remat="full")[0].as_text())
    assert z3["inside_loop"]["all-gather"]["count"] == 14


@pytest.mark.slow
def test_planner_counts_bf16_master_params_and_the_compiled_step_agrees():
    """precision params=bfloat16 halves params and Adam moments in the planner's analytic
    figures, and the compiled step's argument bytes are exactly those figures."""
    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.planner.abstract_step import build_step
    from fsdp_jax.app.planner.memory_model import analytic_memory

    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    out = {}
    for p in ("float32", "bfloat16"):
        cfg = load_config(
            root / "configs" / "tiny.yaml", TINY_MODEL_OVERRIDES + [f"precision=params={p},compute=bfloat16"]
        )
        b = build_step(cfg, "full_shard")
        out[p] = (b, analytic_memory(b))
    (b16, a16), (_, a32) = out["bfloat16"], out["float32"]
    assert 2 * a16["params"] == a32["params"]
    ints = sum(
        x.size * x.dtype.itemsize for x in jax.tree.leaves((b16.state.opt_state, b16.state.step)) if x.dtype.kind == "i"
    )  # the step and optax's counts stay int32
    assert ints < 64 and 2 * (a16["optimizer"] - ints) == a32["optimizer"] - ints
    assert {x.dtype.name for x in jax.tree.leaves(b16.state.params)} == {"bfloat16"}
    mem = compiled_memory(b16.compile())
    assert mem["argument"] == a16["params"] + a16["optimizer"] + a16["batch"]
