"""Expert parallelism over `fsdp` (`mesh.rules: {expert: fsdp}`, or `[data, fsdp]`): each
device holds n_experts / n_ep experts whole, their expert dim split over those axes at rest
and in compute under every strategy (`fsdp_jax.sharding.rules.LITERAL_NAMES`: the strategy's
shard group does not replace that `fsdp`, and no other dim of an expert weight also takes
it). Tokens travel by all-to-all inside the MoE layer's shard_map; the rest of the model is
sharded by the strategy. Training matches one device under every strategy, dropless and
with capacity; the compiled step has all-to-all and gathers no expert weight; bad input is
one line, exit 2."""

from __future__ import annotations

import re

import jax
import numpy as np
import pytest
from test_moe_ep import _cfg, _collectives, _train, _worst_leaf

from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rule_table import DEFAULT_RULES
from fsdp_jax.sharding.rules import logical_to_spec
from helpers import TINY_RUN_OVERRIDES, call, one_line

EP_FSDP = {**DEFAULT_RULES, "expert": "fsdp"}
EP_BOTH = {**DEFAULT_RULES, "expert": ("data", "fsdp")}
W = ("layers", "expert", "embed", "mlp")  # w_gate / w_up; w_down is (layers, expert, mlp, embed)


def test_expert_dim_keeps_fsdp_under_every_shard_group_and_no_other_dim_takes_it():
    """The strategy's shard group (full_shard: data, fsdp, context; hybrid: fsdp, context;
    ZeRO-1 / DDP params: none) replaces the `fsdp` of embed, never of expert; the expert dim
    claims fsdp even when it comes after embed."""
    for group, embed in [
        (("data", "fsdp", "context"), ("data", "context")),
        (("fsdp", "context"), "context"),
        ((), None),
    ]:
        assert logical_to_spec(W, EP_FSDP, group) == jax.sharding.PartitionSpec(None, "fsdp", embed, "tensor")
    assert logical_to_spec(("embed", "expert"), EP_FSDP, ("data", "fsdp")) == jax.sharding.PartitionSpec("data", "fsdp")
    assert logical_to_spec(W, EP_BOTH, ()) == jax.sharding.PartitionSpec(None, ("data", "fsdp"), None, "tensor")
    # without an expert rule nothing changes: embed takes the whole shard group
    assert logical_to_spec(W, DEFAULT_RULES, ("data", "fsdp")) == jax.sharding.PartitionSpec(
        None, None, ("data", "fsdp"), "tensor"
    )


def _specs(built, name="w_gate"):
    """(at rest, compute, grads) specs of one expert weight."""
    plan = built.plan
    pick = lambda t: t["segments"][0]["layers"][0]["moe"][name].spec  # noqa: E731
    return pick(plan.params), pick(plan.compute), pick(plan.grads)


STRATEGIES = ["full_shard", "shard_grad_op", "shard_opt", "no_shard", "hybrid_shard"]
MESHES = [
    ((1, 8, 1), "full_shard", EP_FSDP),  # one expert per device, nothing else of them sharded
    ((2, 4, 1), "full_shard", EP_FSDP),  # two per device; their embed dim over data (ZeRO-3 there)
    ((1, 8, 1), "shard_grad_op", EP_FSDP),
    ((1, 8, 1), "shard_opt", EP_FSDP),
    ((1, 8, 1), "no_shard", EP_FSDP),
    ((2, 4, 1), "hybrid_shard", EP_FSDP),  # experts over fsdp, replicated over data
    ((2, 4, 1), "full_shard", EP_BOTH),  # one per device over data x fsdp
]


def _check_layout(built, shape, strategy, rules):
    n_ep = shape[1] * (shape[0] if rules is EP_BOTH else 1)
    ep = "fsdp" if rules is EP_FSDP else ("data", "fsdp")
    for name in ("w_gate", "w_down"):
        rest, compute, grads = _specs(built, name)
        for spec in (rest, compute, grads):
            assert spec[1] == ep, (strategy, name, spec)  # the expert dim: split in every layout
            assert "fsdp" not in jax.tree.leaves(tuple(spec[2:])), (strategy, name, spec)
        w = built.abstract_state.params["segments"][0]["layers"][0]["moe"][name]
        assert w.sharding.shard_shape(w.shape)[1] == 8 // n_ep


@pytest.mark.slow
def test_dropless_experts_over_fsdp_train_like_one_device_under_every_strategy():
    """3 SGD steps (f32, aux loss on): losses within 1e-5 relative of one device and the
    params after them within 1e-6 relative per leaf, under every strategy, the experts split
    over fsdp (or data x fsdp) in every layout."""
    cfg = _cfg()
    one, _, p_one, _ = _train(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), "full_shard")
    assert one[-1] < one[0]
    for shape, strategy, rules in MESHES:
        got, dropped, params, built = _train(cfg, make_mesh(*shape), strategy, rules)
        assert np.abs(got / one - 1).max() <= 1e-5, (shape, strategy, got, one)
        assert _worst_leaf(params, p_one) <= 1e-6, (shape, strategy)
        assert not dropped.any()
        _check_layout(built, shape, strategy, rules)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_capacity_mode_experts_over_fsdp_match_the_same_mesh_without(strategy):
    """Capacity is per batch shard: compared on the same mesh with the experts not split,
    the same tokens dropped, the same losses and params, under every strategy."""
    cfg = _cfg(capacity_factor=1.0)
    shape = (2, 4, 1) if strategy == "hybrid_shard" else (1, 8, 1)
    ref, ref_dropped, p_ref, _ = _train(cfg, make_mesh(*shape), strategy)
    got, dropped, params, built = _train(cfg, make_mesh(*shape), strategy, EP_FSDP)
    assert ref_dropped.min() > 0 and np.array_equal(dropped, ref_dropped)
    assert np.abs(got / ref - 1).max() <= 1e-5, (got, ref)
    assert _worst_leaf(params, p_ref) <= 1e-6
    _check_layout(built, shape, strategy, EP_FSDP)


# an expert weight's shape: all 8 experts, or 2 or 4 of them (any gathered stack), with its
# (embed, mlp) / (mlp, embed) dims whole or split over data (2 x 16)
EXPERT_SHAPES = re.compile(r"\[(\d+,)?(8|4|2|1),(32|16),(48|24)\]|\[(\d+,)?(8|4|2|1),(48|24),(32|16)\]")


@pytest.mark.slow
def test_compiled_full_shard_step_moves_tokens_by_all_to_all_and_never_gathers_an_expert():
    """full_shard on fsdp=8 with experts over fsdp: all-to-all in the step and no all-gather
    producing any expert-weight shape (neither the 8 experts' stack nor a device's own); the
    same mesh without the rule gathers the (8, 32, 48) stacks. On data=2 x fsdp=4 the only
    expert gathers are a device's own 2 experts over data (their embed dim is ZeRO-3 over
    data), never 4 or 8 of them."""
    cfg = _cfg()
    mesh = make_mesh(1, 8, 1)
    ep = _collectives(cfg, mesh, "full_shard", EP_FSDP)  # the dropless test's first two meshes: their compiles
    plain = _collectives(cfg, mesh, "full_shard")
    assert sum(op == "all-to-all" for op, _ in ep) >= 3, ep
    assert not [s for op, s in ep if op == "all-gather" and EXPERT_SHAPES.search(s)], ep
    assert not [op for op, _ in plain if op == "all-to-all"]
    assert len([s for op, s in plain if op == "all-gather" and re.search(r"\[(\d+,)?8,(32,48|48,32)\]", s)]) >= 3

    hsdp = _collectives(cfg, make_mesh(2, 4, 1), "full_shard", EP_FSDP)
    gathered = [s for op, s in hsdp if op == "all-gather" and EXPERT_SHAPES.search(s)]
    assert sum(op == "all-to-all" for op, _ in hsdp) >= 3
    assert gathered and all(re.search(r"\[(\d+,)?2,(32,48|48,32)\]", s) for s in gathered), gathered


def test_experts_over_fsdp_bad_input_is_one_line_exit_2(tmp_path, capsys):
    run = tmp_path / "run"
    base = ["--config", "configs/tiny.yaml", *TINY_RUN_OVERRIDES, f"run_dir={run}", "train.steps=1"]
    moe = ["model.n_experts=6", "model.experts_per_token=2", "model.moe_ffn_dim=32", "mesh.data=2", "mesh.fsdp=4"]
    rc, _, err = call("train", *base, *moe, "mesh.rules.expert=fsdp", capsys=capsys)
    one_line(rc, err, "model.n_experts", "6", "fsdp", "size 4")
    rc, _, err = call("train", *base, *moe, "model.n_experts=4", "mesh.rules.expert=[data,fsdp]", capsys=capsys)
    one_line(rc, err, "model.n_experts", "4", "data, fsdp", "size 8")
    rc, _, err = call("train", *base, *moe, "model.n_experts=8", "mesh.rules.expert=context", capsys=capsys)
    one_line(rc, err, "mesh.rules.expert", "context")
    rc, _, err = call("train", *base, *moe, "model.n_experts=8", "mesh.rules.expert=[fsdp,tensor]", capsys=capsys)
    one_line(rc, err, "mesh.rules.expert", "tensor")
    assert not run.exists()
