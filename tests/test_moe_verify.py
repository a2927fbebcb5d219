"""`verify` on mixture-of-experts models compares the trainer's objective: cross-entropy plus
`router_aux_loss_coef` x aux + `router_z_loss_coef` x z, as the trainer's step computes it,
under every strategy; a router term that differs between the one-device run and a sharded
one is caught; a published MoE config is shrunk keeping its expert dims' divisibility."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

from fsdp_jax.app.models import moe as moe_lib
from fsdp_jax.app.models.decoder import cross_entropy
from fsdp_jax.app.trainer.build import build_from_config, trainer_model
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.app.verify_batches import verify_batches
from fsdp_jax.app.verify_shrink import shrunk_model
from fsdp_jax.sharding.mesh import make_mesh
from helpers import TINY_MODEL_OVERRIDES, call

MOE_OVERRIDES = [
    *TINY_MODEL_OVERRIDES,
    "model.n_experts=4",
    "model.experts_per_token=2",
    "model.moe_ffn_dim=64",
    "model.router_aux_loss_coef=0.1",
    "model.router_z_loss_coef=0.01",
    "data.source=none",
]


def _cfg(*more):
    return load_run_config("configs/tiny.yaml", [*MOE_OVERRIDES, *more])


# verify's run of the MoE config with 8 experts and the default rules, every strategy: one run serves
# the trainer's-objective test and, as "the same config without the rule", the expert-parallelism one
_RUNS: dict[str, dict] = {}


def _plain_doc(capsys) -> dict:
    if "plain" not in _RUNS:
        _RUNS["plain"] = _verify_doc(capsys, "model.n_experts=8")
    return _RUNS["plain"]


@pytest.mark.slow
def test_verify_passes_on_a_moe_config_with_the_trainers_objective(capsys):
    """Every strategy passes; verify's reference loss at step 1 is the trainer's step loss
    on the same params and batch (so it holds the router terms), and that differs from the
    bare cross-entropy by exactly coef x aux + z_coef x z."""
    doc = _plain_doc(capsys)
    assert doc["passed"] and len(doc["strategies"]) == 5
    assert doc["routing"] == "expert_load"  # compared exactly: the same choices at every step here
    for r in doc["strategies"].values():
        assert r["routing_flip_step"] is None and r["routing_diff"] == [0.0, 0.0], r["routing_diff"]

    cfg = _cfg("model.n_experts=8")
    batch = verify_batches(cfg, 1, 0)[0][0]
    model = trainer_model(cfg.model, cfg.remat)
    one = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    built = build_from_config(cfg, model, optax.sgd(0.0), one, "no_shard", max_replicated_fraction=None)
    state = built.init_state(jax.random.key(0))  # verify's init: seed 0
    params = jax.device_get(state.params)
    _, metrics = built.train_step(state, batch)
    trainer_loss = float(metrics["loss"])
    assert abs(doc["reference_loss"][0] / trainer_loss - 1) < 1e-6, (doc["reference_loss"], trainer_loss)

    @jax.jit  # one program on one device, not one per op of the model
    def parts(params, batch):
        logits, stats = model.apply(params, batch[:, :-1], router=True)
        return cross_entropy(logits, batch[:, 1:]), moe_lib.aux_loss(stats), moe_lib.z_loss(stats)

    ce, aux, z = map(float, parts(params, batch))
    terms = 0.1 * aux + 0.01 * z
    assert terms > 1e-3 * ce  # far above verify's tolerance: a verify without them would differ
    assert abs(trainer_loss - (ce + terms)) < 1e-5 * trainer_loss


@pytest.mark.slow
def test_verify_catches_a_router_term_that_differs_on_the_sharded_side(capsys, monkeypatch):
    """verify's command on the MoE config of the trainer's-objective test, its loss made wrong:
    the aux coefficient doubled whenever the step's mesh has more than one device. The
    one-device reference and every sharded run then optimise different objectives, and verify
    fails them at step 1 on the loss (exit 1). The same command with the trainer's loss passes:
    that test's run (shared), whose full_shard and no_shard are these."""
    from fsdp_jax.app.cli.run import verify as verify_command

    make = verify_command.make_loss_fn

    def make_wrong(model, mcfg):
        good = make(model, mcfg)

        def wrong(params, batch):
            loss, aux = good(params, batch)
            if jax.sharding.get_abstract_mesh().size > 1:  # traced under the step's mesh
                loss = loss + mcfg.router_aux_loss_coef * aux["router_aux_loss"]
            return loss, aux

        return wrong

    monkeypatch.setattr(verify_command, "make_loss_fn", make_wrong)
    rc, out, err = call(
        "verify", "--config", "configs/tiny.yaml", "--steps", "2", "--json", "--strategies", "full_shard,no_shard",
        *MOE_OVERRIDES, "model.n_experts=8", capsys=capsys,
    )  # fmt: skip
    assert rc == 1, err[-3000:] + out
    report = json.loads(out)
    assert not report["passed"] and set(report["strategies"]) == {"full_shard", "no_shard"}
    for s in report["strategies"].values():
        assert not s["passed"] and s["first_divergence"]["step"] == 1 and s["first_divergence"]["loss"] is not None
    monkeypatch.undo()
    plain = _plain_doc(capsys)  # the same run with one objective passes
    assert plain["passed"] and all(plain["strategies"][s]["passed"] for s in ("full_shard", "no_shard"))


DOCS_MOE = [
    "model.n_experts=8",
    "model.experts_per_token=2",
    "model.moe_ffn_dim=352",
    "model.norm_topk_prob=true",
    "model.router_aux_loss_coef=0.01",
    "data.source=none",
]


@pytest.mark.slow
def test_adamw_moe_verify_stops_judging_at_the_routing_flip(capsys):
    """docs/moe.md's tiny MoE with AdamW (the config's optimizer): after a step or two a token
    whose 2nd and 3rd router probabilities nearly tie may land on another expert in the 8-device
    step than on one device (benchmarks/moe_routing_flips.py), so the expert load differs by a
    whole number of the 16384 (token, expert) pairs and the experts' params jump past the
    adaptive-f32 limit. Whether and which step flips depends on XLA:CPU's rounding, so on the
    CPU it runs on (step 3 from the command line and step 2 under this suite's XLA flags on the
    machine the test was written on; none in 6 steps on an AVX-512 AMD EPYC): verify reports the
    flip's step and judges the steps before it, which are within the unchanged limit; without a
    flip every step is judged and within it. The flip's handling on its own, with a flip forced:
    test_verify.py's test_a_routing_flip_stops_the_judging_at_its_step_and_is_reported.
    Two steps: under this suite's flags the one flip seen came at step 2, and what a later flip
    would exercise is test_verify.py's forced flip. A step of this model is ~6 CPU seconds of
    execution on one device and as much on 8 (XLA:CPU expands each of its 36 grouped products,
    3 forward and 6 backward in each of 4 layers, into 8 masked dense dots: 0.11 s for one of
    the (4096, 256) x (8, 256, 352) forward products against 0.01 s for one dense dot): a
    third step was ~12 of the test's 50 CPU seconds (BENCHMARKS.md, Issue 55 item 6, verify)."""
    rc, out, err = call(
        "verify", "--config", "configs/tiny.yaml", "--steps", "2", "--json", "--strategies", "full_shard",
        *DOCS_MOE, capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err[-3000:] + out
    doc = json.loads(out)
    r = doc["strategies"]["full_shard"]
    limit = doc["tolerance"]["param_rtol"]
    assert doc["tolerance"]["name"] == "adaptive-f32" and limit == 5e-5
    assert doc["passed"] and r["first_divergence"] is None, r
    s = r["routing_flip_step"]
    if s is None:  # no flip on this CPU: both steps judged, equal choices, within the limit
        assert r["routing_diff"] == [0.0] * 2 and max(r["param_rel_diff"]) <= limit, r
        return
    assert s == 2, r  # step 1 starts from the same params: a flip there is a divergence
    pairs = r["routing_diff"][s - 1] * 16384
    assert r["routing_diff"][: s - 1] == [0.0] * (s - 1) and pairs >= 1 and pairs == round(pairs)
    assert max(r["param_rel_diff"][: s - 1]) <= limit < r["param_rel_diff"][s - 1]  # the jump: reported, not judged


def test_shrunk_moe_config_keeps_the_expert_dims_divisibility():
    """Mixtral-8x7B and Qwen3-30B-A3B shrink for verify: experts and the expert FFN shrink with
    the same gcd with the device count, top-k fits, the published top-k stays."""
    for name in ("mixtral_8x7b", "qwen3_30b_a3b"):
        m = load_run_config(f"configs/{name}.yaml").model
        new, changed = shrunk_model(m, 8)
        assert new.n_experts <= max(8, m.experts_per_token) * 2 and new.experts_per_token == m.experts_per_token
        assert new.experts_per_token <= new.n_experts
        for k in ("n_experts", "moe_ffn_dim"):
            assert np.gcd(getattr(new, k), 8) == np.gcd(getattr(m, k), 8), k
        assert new.moe_ffn_dim < m.moe_ffn_dim and "model.moe_ffn_dim" in changed


@pytest.mark.slow
def test_cli_verifies_mixtral_shrunk(capsys):
    rc, out, err = call(
        "verify", "--config", "configs/mixtral_8x7b.yaml", "--strategies", "full_shard", "--steps", "1", "--json",
        "data.source=none", capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err[-3000:] + out
    doc = json.loads(out)
    assert doc["passed"] and doc["shrunk"]["model.moe_ffn_dim"][0] == 14336


def _verify_doc(capsys, *more, strategies="all"):
    rc, out, err = call(
        "verify", "--config", "configs/tiny.yaml", "--steps", "2", "--json", "--strategies", strategies,
        *MOE_OVERRIDES, *more, capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err[-3000:] + out
    return json.loads(out)


def _all_to_all(report) -> int:
    return report["collectives_per_step"].get("all-to-all", {}).get("count", 0)


@pytest.mark.slow
def test_verify_runs_the_configs_expert_parallelism_over_fsdp(capsys):
    """`mesh.rules.expert=fsdp`: verify builds every strategy with the config's rules, so the
    experts are split over fsdp and tokens move by all-to-all in each compiled step (the same
    config without the rule has none), and every strategy still matches one device."""
    doc = _verify_doc(capsys, "model.n_experts=8", "mesh.rules.expert=fsdp")
    assert doc["passed"] and len(doc["strategies"]) == 5
    for name, r in doc["strategies"].items():
        assert _all_to_all(r) > 0, (name, r["collectives_per_step"])
    assert any("experts over fsdp" in n and "full_shard 8" in n and "hybrid_shard 4" in n for n in doc["notes"])
    # the same config without the rule: full_shard and no_shard move no tokens by all-to-all (the
    # partitioner may pick one for another strategy's replicated experts)
    plain = _plain_doc(capsys)
    assert plain["passed"] and not any(_all_to_all(plain["strategies"][s]) for s in ("full_shard", "no_shard"))


@pytest.mark.slow
def test_verify_runs_experts_over_data_on_the_configs_data_split(capsys):
    """`mesh.rules.expert=data` with mesh.data=2: every strategy's mesh is data=2 x fsdp=4 (the
    run's split, so the experts' axis exists), with all-to-all, and matches one device."""
    more = ("model.n_experts=4", "mesh.rules.expert=data", "mesh.data=2", "mesh.fsdp=-1")
    doc = _verify_doc(capsys, *more, strategies="full_shard,shard_opt,hybrid_shard")
    assert doc["passed"]
    for name, r in doc["strategies"].items():
        assert r["mesh"]["data"] == 2 and r["mesh"]["fsdp"] == 4 and _all_to_all(r) > 0, (name, r["mesh"])


def test_verify_refuses_experts_its_meshes_cannot_split(capsys):
    """n_experts=4 over fsdp: the config's own mesh (fsdp=8 of 8 devices) cannot hold them
    either; verify says so in one line naming model.n_experts, exit 2. An axis that cannot
    hold experts is refused as by train."""
    from helpers import one_line

    base = ["verify", "--config", "configs/tiny.yaml", "--steps", "1", *MOE_OVERRIDES]
    rc, _, err = call(*base, "model.n_experts=4", "mesh.rules.expert=fsdp", capsys=capsys)
    one_line(rc, err, "model.n_experts", "4", "fsdp", "size 8")
    rc, _, err = call(*base, "mesh.rules.expert=context", capsys=capsys)
    one_line(rc, err, "mesh.rules.expert", "context")


@pytest.mark.parametrize(
    "rules,data", [({"expert": "fsdp"}, 1), ({"expert": ["data", "fsdp"]}, 2)], ids=["fsdp", "data_fsdp"]
)
def test_shrink_keeps_the_expert_split_of_the_configs_rules(rules, data):
    """Qwen3-30B-A3B (128 experts) shrinks to 8 experts: divisible by the expert axes of every
    verify mesh (8 over fsdp, or 2 x 4), and every param's spec under the config's rules,
    the expert split among them, is the same for the full and the reduced model (the shrink
    compares them, RuntimeError otherwise)."""
    import dataclasses

    from fsdp_jax.app.verify_shrink import _rows, shrink_config

    cfg = load_run_config("configs/qwen3_30b_a3b.yaml", [f"mesh.rules.expert={rules['expert']}".replace("'", "")])
    cfg = dataclasses.replace(cfg, mesh=dataclasses.replace(cfg.mesh, data=data, fsdp=-1))
    strategies = ["full_shard", "no_shard", "hybrid_shard"]
    small, changed, _ = shrink_config(cfg, 8, strategies, jax.devices(), data)
    assert small.model.n_experts == 8 and changed["model.n_experts"] == (128, 8)
    rows = _rows(small.model, small.mesh.min_shard_size, "no_shard", jax.devices(), small.remat, small.mesh.rules, data)
    ep = "fsdp" if data == 1 else ("data", "fsdp")
    experts = [spec for path, (_, spec) in rows.items() if path.endswith("w_gate")]
    assert experts and all(spec[1] == ep for spec in experts), experts
