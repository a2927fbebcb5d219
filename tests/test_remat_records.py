"""A remat policy is one record (`fsdp_jax.sharding.remat.RematPolicy`): the planner's memory,
MoE, context and step-time models read its fields. Every shipped policy's estimates equal
the formulas of the planner's docstrings written out here by hand, and a policy added in a
test alone gets a memory and a step-time estimate without any planner code naming it."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.planner import moe_memory
from fsdp_jax.app.planner.context_memory import context_attention_bytes
from fsdp_jax.app.planner.memory_model import activation_bytes
from fsdp_jax.app.planner.residuals import saved_per_token
from fsdp_jax.app.planner.search_prediction import predict_step, recompute_flops_per_token
from fsdp_jax.app.planner.search_report import parse_remats
from fsdp_jax.app.planner.search_space import SearchSpace
from fsdp_jax.errors import PlanError
from fsdp_jax.sharding import remat as rm
from helpers import TINY_MODEL_OVERRIDES

# every dim distinct, so a term counted with the wrong dim cannot agree by accident
M = DecoderConfig(vocab_size=256, d_model=96, n_layers=3, n_heads=6, n_kv_heads=2, ffn_dim=200, max_seq_len=64)
D, F, H, L = 96, 200, 6, 3
Q, K = 6 * 16, 2 * 16  # heads x head_dim, kv heads x head_dim (head_dim = 96 / 6)
S = 64
SHIPPED = (
    "none",
    "full",
    "dots",
    "dots_no_batch",
    "save_attn_mlp_out",
    "save_qkv_attn_mlp_out",
    "offload_attn_mlp_out",
    "offload_qkv_attn_mlp_out",
    "offload_dots_no_batch",
)


def dense_by_hand(name: str, c: int, flash: bool) -> int:
    """`planner/residuals.py`'s docstring, policy by policy."""
    return {
        "none": c * (3 * D + 2 * Q + 2 * K + 4 * F) + (4 * H if flash else H * S * (4 + c)),
        "dots": c * (2 * Q + 2 * K + 2 * D + 2 * F) + (-c * Q if flash else 4 * H * S),
        "dots_no_batch": c * (Q + 2 * K + 2 * D + 2 * F),
        "save_attn_mlp_out": 2 * c * D,
        "save_qkv_attn_mlp_out": c * (Q + 2 * K + 2 * D),
    }.get(name, 0)  # full and the offloading policies: nothing on the device


def test_the_shipped_records_are_the_registry():
    assert tuple(rm.REMAT_POLICIES) == SHIPPED  # the config's allowed list, in its order
    assert rm.device_policies() == (
        "none",
        "dots",
        "dots_no_batch",
        "save_qkv_attn_mlp_out",
        "save_attn_mlp_out",
        "full",
    )
    assert rm.offloading() == {n for n in SHIPPED if n.startswith("offload_")}
    assert all(rm.REMAT_POLICIES[n].offload_dst == "pinned_host" for n in rm.offloading())
    assert rm.get_policy("none") is None and rm.REMAT_POLICIES["none"].keeps_everything
    assert rm.get_policy("full") is jax.checkpoint_policies.nothing_saveable
    with pytest.raises(ValueError, match="choose one of none, full"):
        rm.remat_policy("dot")


@pytest.mark.parametrize("attention", ["xla", "cudnn"])
@pytest.mark.parametrize("c", [2, 4])
def test_every_shipped_policy_keeps_what_the_formula_says(attention, c):
    m = dataclasses.replace(M, attention=attention)
    for name in SHIPPED:
        assert saved_per_token(m, name, S, c) == dense_by_hand(name, c, attention == "cudnn"), name
        # the whole activation estimate: L layers of (input + saved) per token, plus the rest
        b = 2
        base = activation_bytes(m, "full", b, S, "float32" if c == 4 else "bfloat16")
        got = activation_bytes(m, name, b, S, "float32" if c == 4 else "bfloat16")
        assert got["layers"] - base["layers"] == L * b * S * dense_by_hand(name, c, attention == "cudnn"), name
        assert (got["working"], got["head"]) == (base["working"], base["head"]), name


def test_every_shipped_policy_keeps_its_moe_and_context_terms():
    """`moe_memory`'s docstring: none all terms; dots router logits and combine (capacity mode:
    the experts' batched matmuls too); dots_no_batch the router logits; shared expert gate and
    up under both dots policies; the others nothing. `context_memory`'s: dots every step's
    scores and outputs, none q/k/v and block outputs, the others nothing."""
    e, f, fs, c, t = 8, 48, 40, 2, 128
    moe = dataclasses.replace(M, n_experts=e, experts_per_token=2, moe_ffn_dim=f, shared_expert_ffn_dim=fs)
    cap = dataclasses.replace(moe, capacity_factor=1.0)
    r = moe_memory.expert_rows_per_token(cap, t)
    for name in SHIPPED:
        everything = name == "none"
        dots = {"dots": c * (e + D + 2 * fs), "dots_no_batch": c * (e + 2 * fs)}.get(name, 0)
        want = moe_memory.moe_working_per_token(moe, t, c, 1, False) if everything else dots
        assert moe_memory.moe_saved_per_token(moe, name, t, c) == want, name
        want = moe_memory.moe_working_per_token(cap, t, c, 1, False) if everything else dots
        extra = c * r * (2 * f + D) if name == "dots" else 0
        assert moe_memory.moe_saved_per_token(cap, name, t, c) == pytest.approx(want + extra), name
        dense = {"none": 4 * c * F, "dots": 2 * c * F, "dots_no_batch": 2 * c * F}.get(name, 0)
        assert moe_memory.dense_mlp_per_token(moe, name, c) == dense, name

        n, b, s = 4, 2, S // 4
        ring = {
            "dots": n * b * H * s * s * 4 + n * b * s * 4 * Q,
            "none": n * b * s * 3 * (c * (Q + 2 * K) + 4 * Q + 8 * H) // 2,
        }
        assert context_attention_bytes(M, name, b, S, c, n, 2048)["saved"] == ring.get(name, 0), name


def test_every_shipped_policy_recomputes_what_its_record_says():
    """search_prediction's FLOPs per layer: qkv 2D(Q+2K), core 4SQ, gate+up 4DF; `full`'s whole
    forward is step_time's (0 here, one more forward there)."""
    qkv, core, gate_up = 2 * D * (Q + 2 * K), 4 * S * Q, 4 * D * F
    want = {
        "dots_no_batch": core,
        "save_qkv_attn_mlp_out": core + gate_up,
        "save_attn_mlp_out": qkv + core + gate_up,
        "offload_attn_mlp_out": qkv + core + gate_up,
        "offload_qkv_attn_mlp_out": core + gate_up,
        "offload_dots_no_batch": core,
    }
    for name in SHIPPED:
        assert recompute_flops_per_token(M, S, name) == L * want.get(name, 0), name
    assert {n for n in SHIPPED if rm.FORWARD in rm.REMAT_POLICIES[n].recomputes} == {"full"}


SAVE_QKV = rm.RematPolicy(
    "save_qkv",
    jax.checkpoint_policies.save_only_these_names("qkv"),
    saves={"qkv"},
    recomputes={"attn_core", "attn_out", "gate_up"},
)


@pytest.fixture
def save_qkv(monkeypatch):
    """A new policy, registered for this test alone: one record, no planner code."""
    monkeypatch.setitem(rm.REMAT_POLICIES, SAVE_QKV.name, SAVE_QKV)
    return SAVE_QKV


def test_a_new_policy_is_one_record(save_qkv):
    c = 2
    assert saved_per_token(M, "save_qkv", S, c) == c * (Q + 2 * K)
    full = activation_bytes(M, "full", 2, S, "bfloat16")
    got = activation_bytes(M, "save_qkv", 2, S, "bfloat16")
    assert got["layers"] - full["layers"] == L * 2 * S * c * (Q + 2 * K)
    moe = dataclasses.replace(M, n_experts=8, experts_per_token=2, moe_ffn_dim=48)
    assert moe_memory.moe_saved_per_token(moe, "save_qkv", 128, c) == 0  # no MoE term is named qkv
    assert context_attention_bytes(M, "save_qkv", 2, S, c, 4, 2048)["saved"] == 0
    assert recompute_flops_per_token(M, S, "save_qkv") == L * (4 * S * Q + 2 * Q * D + 4 * D * F)

    # the trainer's config takes it, and the step-time model predicts it: its recompute on
    # top of `dots`'s step (which recomputes nothing)
    cfg = load_config("configs/tiny.yaml", [*TINY_MODEL_OVERRIDES, "remat=save_qkv"])
    res = {"analytic": {"grads": 0, "params": 0, "optimizer": 0}, "communication": {"total_wire_bytes": 0}}
    new, dots = (predict_step(dataclasses.replace(cfg, remat=r), "h100", 8, res) for r in ("save_qkv", "dots"))
    m = cfg.model
    per_token = recompute_flops_per_token(m, cfg.data.seq_len, "save_qkv")
    assert per_token > 0 and new["recompute_s"] > 0 and dots["recompute_s"] == 0
    assert new["step_s"] > dots["step_s"]

    # the search: only when asked for (no search_rank), and then as any other
    assert "save_qkv" not in SearchSpace().remats and parse_remats("save_qkv,dots") == ("save_qkv", "dots")


def test_a_new_policy_with_a_search_rank_is_searched(monkeypatch):
    ranked = dataclasses.replace(SAVE_QKV, search_rank=2.5)
    monkeypatch.setitem(rm.REMAT_POLICIES, ranked.name, ranked)
    assert rm.device_policies()[2:4] == ("dots_no_batch", "save_qkv")
    assert "save_qkv" in SearchSpace().remats and "save_qkv" in parse_remats(None)


def test_a_new_policy_saves_its_residuals_in_jax(save_qkv, capsys):
    """The record's jax policy is what `with_remat` applies: only the `qkv`-named value is
    saved besides the inputs, and the gradient is the one without remat."""
    from jax.ad_checkpoint import checkpoint_name, print_saved_residuals

    def f(x, w):
        qkv = checkpoint_name(jnp.sin(x @ w), "qkv")
        return jnp.sum(jnp.tanh(qkv @ w.T) ** 2)

    x, w = (
        jnp.asarray(np.ones((4, 8), np.float32) * 0.1),
        jnp.asarray(np.arange(64.0, dtype=np.float32).reshape(8, 8) / 64),
    )
    print_saved_residuals(rm.with_remat(f, "save_qkv"), x, w)
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3 and "named 'qkv'" in lines[2], lines  # x, w and qkv
    print_saved_residuals(rm.with_remat(f, "none"), x, w)
    assert len(capsys.readouterr().out.splitlines()) > 3  # without remat: cos, tanh, ... too
    # both gradients compiled whole (eagerly, each op of the forward and backward was a program)
    got, want = jax.jit(jax.grad(rm.with_remat(f, "save_qkv")))(x, w), jax.jit(jax.grad(f))(x, w)
    assert np.allclose(got, want, rtol=1e-6)


def test_unknown_policies_and_bad_records_are_refused():
    with pytest.raises(PlanError, match="no activation formula for policy 'dot'; known: none, full"):
        saved_per_token(M, "dot", S, 2)
    with pytest.raises(ValueError, match="recomputes"):
        rm.RematPolicy("x", None, recomputes={"softmax"})
    with pytest.raises(ValueError, match="offload_dst"):
        rm.RematPolicy("x", None, offloads={"qkv"})
