"""The inspector on the project's own model: the embedding gradient's all-to-all, which
`fsdp_jax.sharding.precision.take` asks XLA for, is not reported as an activation resharded
against the layout; an involuntary rematerialization is named by its HLO instruction in both
wordings XLA uses (never `? ?`)."""

import json

import pytest

from fsdp_jax.app.planner.report import embedding_gradient, explicit_all_to_all, sharding_warnings
from fsdp_jax.hlo.findings import involuntary_rematerializations, rematerialization_warning
from helpers import call

# Logged by XLA:GPU (jax 0.10.2) compiling Llama-2-7B hybrid_shard for 2 hosts x 8 H100:
#   python scripts/inspect.py --config configs/llama2_7b.yaml --target h100 --devices 16 \
#       --hosts 2 --strategy hybrid_shard train.global_batch=16
NEW_WORDING = (
    "W1201 22:15:28.784548    3451 spmd_partitioner.cc:656] [SPMD] Involuntary full rematerialization. "
    "The compiler cannot go from sharding {devices=[16,1,1]<=[16]} to {devices=[1,1,8,2]<=[2,8]T(1,0) "
    "last_tile_dim_replicate} efficiently for HLO operation %fake_parameter.2 = f32[1,4096,4096]{2,1,0} "
    "parameter(2), sharding={devices=[16,1,1]<=[16]}. As the last resort, SPMD will replicate the tensor "
    "and then partition it to obtain the target sharding, which is inefficient. This issue will be fixed "
    "by Shardy partitioner in the future, which is tracked in b/433785288. Contact Shardy or XLA team for help."
)


def test_the_newer_rematerialization_wording_names_the_instruction():
    [r] = involuntary_rematerializations("I0000 other\n" + NEW_WORDING)
    assert r == {
        "tensor": "fake_parameter.2",
        "shape": "f32[1,4096,4096]{2,1,0}",
        "opcode": "parameter",
        "from": "{devices=[16,1,1]<=[16]}",
        "to": "{devices=[1,1,8,2]<=[2,8]T(1,0) last_tile_dim_replicate}",
        "op_name": "",
    }
    w = rematerialization_warning(r)
    assert w.startswith("involuntary full rematerialization of fake_parameter.2 f32[1,4096,4096]{2,1,0} (parameter)")
    assert "?" not in w


def test_a_wording_it_does_not_know_is_quoted_not_replaced_by_placeholders():
    [r] = involuntary_rematerializations("E0 x.cc:1] [SPMD] Involuntary full rematerialization of %dot.3, somehow")
    assert rematerialization_warning(r) == (
        "the partitioner reported: Involuntary full rematerialization of %dot.3, somehow"
    )


def _report(op_names):
    entry = {"count": len(op_names), "bytes": 1 << 20, "op_names": op_names}
    return {
        "per_step": {"all-to-all": {"count": len(op_names), "bytes": 1 << 20}},
        "inside_loop": {},
        "outside_loop": {"all-to-all": entry},
        "loops": [],
    }


EMBED_GRAD = "jit(step)/transpose(jvp(forward))/transpose(jvp(jit(_take)))/scatter-add"


def test_only_all_to_alls_other_than_the_embedding_gradient_are_flagged():
    assert embedding_gradient(EMBED_GRAD) and not embedding_gradient("jit(step)/jvp(forward)/while/body/dot_general")
    args = dict(rows=[], strategy="full_shard", mesh_shape_={"fsdp": 8}, replicated_threshold=1 << 30)
    assert sharding_warnings(report=_report([EMBED_GRAD]), **args) == []
    [w] = sharding_warnings(report=_report([EMBED_GRAD, "jit(step)/jvp(forward)/while/body/transpose"]), **args)
    assert w.startswith("activations resharded with all-to-all: 1 per step (and 1 for the embedding gradient")
    assert "(ops: transpose)" in w


@pytest.mark.slow
def test_the_reference_model_with_bf16_compute_inspects_without_the_all_to_all_warning(capsys):
    rc, out, err = call(
        "inspect", "--config", "configs/tiny.yaml", "--devices", "8", "--strategy", "full_shard",
        "precision=params=float32,compute=bfloat16,reduce=float32", capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert "all-to-all      " in out or "all-to-all " in out  # the embedding gradient's is there
    assert "warning: activations resharded" not in out


EXCHANGE = "jit(step)/jvp(forward)/while/body/closed_call/shard_map/all_to_all"  # models/moe_exchange.py


def test_the_experts_token_exchange_is_not_flagged():
    """Expert parallelism's all-to-all is a `jax.lax.all_to_all` inside the MoE layer's
    shard_map (its op name ends in shard_map/all_to_all), asked for, not chosen by the
    partitioner; one the partitioner inserts next to it still is."""
    assert explicit_all_to_all(EXCHANGE) and not explicit_all_to_all("jit(step)/jvp(forward)/while/body/transpose")
    args = dict(rows=[], strategy="full_shard", mesh_shape_={"fsdp": 8}, replicated_threshold=1 << 30)
    assert sharding_warnings(report=_report([EXCHANGE, EXCHANGE.replace("jvp", "transpose(jvp")]), **args) == []
    [w] = sharding_warnings(report=_report([EXCHANGE, "jit(step)/jvp(forward)/while/body/transpose"]), **args)
    assert "1 per step (and 1 for the embedding gradient or the experts' exchange" in w


@pytest.mark.slow
def test_experts_over_fsdp_inspect_without_the_all_to_all_warning(capsys):
    moe = ["model.n_experts=8", "model.experts_per_token=2", "model.moe_ffn_dim=64", "mesh.rules.expert=fsdp"]
    rc, out, err = call(
        "inspect", "--config", "configs/tiny.yaml", "--devices", "8", "--strategy", "full_shard",
        "model.n_layers=2", *moe, capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err
    assert "all-to-all" in out and "warning: activations resharded" not in out, out[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("hosts", [2, 4])
def test_bf16_reference_model_plans_without_a_rematerialization_over_every_host_split(hosts, capsys):
    """Issue 56 item 3: hybrid_shard over 2 or 4 hosts of the 8 devices (data 2 x fsdp 4, data 4 x
    fsdp 2) used to rematerialise the embedding lookup's cotangent whole on every device (a
    batch over data x fsdp meeting a table over fsdp, replicated over data); the decoder now
    lays it out for the scatter-add (`decoder.embed_updates_layout`). full_shard and
    shard_grad_op in the same compile child, on the H100 target, with bf16 compute (an f32
    model takes `jnp.take`'s own transpose and never showed it)."""
    rc, out, err = call(
        "plan", "--config", "configs/tiny.yaml", "--devices", "8", "--target", "h100", "--hosts", hosts,
        "--strategies", "full_shard,shard_grad_op,hybrid_shard", "--json",
        "precision=params=float32,compute=bfloat16", capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    doc = json.loads(out)
    assert set(doc["strategies"]) == {"full_shard", "shard_grad_op", "hybrid_shard"}
    for name, r in doc["strategies"].items():
        bad = [w for w in r.get("warnings", []) if "rematerialization" in w or "activations resharded" in w]
        assert not bad, (name, bad)
