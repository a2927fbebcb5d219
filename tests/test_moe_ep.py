"""Expert parallelism over a batch axis (`mesh.rules: {expert: data}`, models/moe_exchange.py):
each device holds n_experts / data of the experts, the (token, expert) pairs travel by
all-to-all inside the MoE layer's shard_map. Training matches one device under every
strategy; the compiled step has all-to-all and no all-gather of the expert weights; bad
input is one line, exit 2."""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fsdp_jax.app.models import Decoder, DecoderConfig
from fsdp_jax.app.trainer.build import make_loss_fn
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rule_table import DEFAULT_RULES
from fsdp_jax.train.build import build
from fsdp_jax.train.step import sharding_context
from helpers import TINY_RUN_OVERRIDES, call, one_line

EP = {**DEFAULT_RULES, "expert": "data"}


def _cfg(**kw):
    """A tiny Mixtral: 8 experts, top-2, renormalised, aux loss on."""
    base = dict(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
        n_experts=8, experts_per_token=2, moe_ffn_dim=48, norm_topk_prob=True, router_aux_loss_coef=0.01,
    )  # fmt: skip
    return DecoderConfig(**{**base, **kw})


def _built(cfg, mesh, strategy, rules=None):
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    loss = make_loss_fn(m, cfg)
    return build(m, optax.sgd(0.5), mesh, strategy, loss_fn=loss, has_aux=True, rules=rules, min_shard_size=0)


TRAINED: dict = {}


def _trained(cfg, mesh, strategy, rules=None, steps=3):
    """((losses, dropped per step, params after `steps` SGD steps, the build), the compiled step's
    text), once per (config, mesh, strategy, rules, steps) in a process: the tests here and in
    tests/test_moe_ep_fsdp.py that train or read the compiled step of one program share its trace
    and compile (its first step runs the step compiled here: jit's cache)."""
    rules_key = None if rules is None else tuple(sorted((k, str(v)) for k, v in rules.items()))
    key = (cfg, mesh.shape_tuple, tuple(d.id for d in mesh.devices.flat), strategy, rules_key, steps)
    if key not in TRAINED:
        built = _built(cfg, mesh, strategy, rules)
        state = built.init_state(jax.random.key(0))
        batch = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab_size)
        text = built.train_step.lower(state, batch).compile().as_text()
        losses, dropped = [], []
        for _ in range(steps):
            state, metrics = built.train_step(state, batch)
            losses.append(float(metrics["loss"]))
            dropped.append(float(metrics["aux"]["dropped_tokens"]))
        TRAINED[key] = (np.asarray(losses), np.asarray(dropped), jax.device_get(state.params), built), text
    return TRAINED[key]


def _train(cfg, mesh, strategy, rules=None, steps=3):
    """(losses, dropped per step, params after `steps` SGD steps, the build), of `_trained`."""
    return _trained(cfg, mesh, strategy, rules, steps)[0]


def _worst_leaf(a, b) -> float:
    return max(
        float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


def _expert_spec(built):
    return built.plan.compute["segments"][0]["layers"][0]["moe"]["w_gate"].spec


MESHES = [
    ((8, 1, 1), "full_shard"),  # one expert per device, the rest ZeRO-3 over the 8
    ((4, 2, 1), "full_shard"),  # two per device; embed dims also over fsdp
    ((4, 2, 1), "shard_grad_op"),
    ((8, 1, 1), "shard_opt"),
    ((2, 4, 1), "no_shard"),
    ((4, 2, 1), "hybrid_shard"),
]


@pytest.mark.slow
def test_dropless_expert_parallelism_trains_like_one_device_under_every_strategy():
    """3 SGD steps (f32, aux loss on): losses within 1e-5 relative of one device, and the
    params after them (so every step's grads) within 1e-6 relative per leaf, with the experts
    split over data in compute (each device holds 8 / data of them)."""
    cfg = _cfg()
    one, _, p_one, _ = _train(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), "full_shard")
    assert one[-1] < one[0]  # it learns
    for shape, strategy in MESHES:
        got, dropped, params, built = _train(cfg, make_mesh(*shape), strategy, EP)
        assert np.abs(got / one - 1).max() <= 1e-5, (shape, strategy, got, one)
        assert _worst_leaf(params, p_one) <= 1e-6, (shape, strategy)
        assert not dropped.any()  # dropless
        spec = _expert_spec(built)
        assert spec[1] == "data", (strategy, spec)  # (layers, expert, embed, mlp): experts stay split
        w = built.abstract_state.params["segments"][0]["layers"][0]["moe"]["w_gate"]
        assert w.sharding.shard_shape(w.shape)[1] == 8 // shape[0]


@pytest.mark.slow
def test_capacity_mode_expert_parallelism_matches_the_same_mesh_without():
    """Capacity is per batch shard, so capacity mode is compared on the same mesh with the
    experts replicated: the same tokens dropped, the same losses and params."""
    cfg = _cfg(capacity_factor=1.0)
    ref, ref_dropped, p_ref, _ = _train(cfg, make_mesh(8, 1, 1), "full_shard")
    got, dropped, params, _ = _train(cfg, make_mesh(8, 1, 1), "full_shard", EP)
    assert ref_dropped.min() > 0 and np.array_equal(dropped, ref_dropped)  # some dropped, the same ones
    assert np.abs(got / ref - 1).max() <= 1e-5, (got, ref)
    assert _worst_leaf(params, p_ref) <= 1e-6


def _collectives(cfg, mesh, strategy, rules=None):
    """(op, result shape) of each all-gather and all-to-all in the compiled train step of `_train(...)`
    (the step its runs ran: one compile for both)."""
    text = _trained(cfg, mesh, strategy, rules)[1]
    ops = [re.match(r"\s*(?:ROOT )?%\S+ = (.*?) (all-gather|all-to-all)\(", line) for line in text.splitlines()]
    return [(m[2], m[1]) for m in ops if m]


@pytest.mark.slow
def test_compiled_step_moves_tokens_by_all_to_all_and_never_gathers_the_experts():
    """With experts over data: all-to-all in the step (dispatch, ids, return; and their
    transposes) and no all-gather producing the 8 experts' (8, 32, 48) / (8, 48, 32) stack;
    without (experts replicated over data in compute) the step gathers exactly those. Neither
    gathers the router logits."""
    cfg = _cfg()
    full_experts = re.compile(r"\[(\d+,)?8,(32,48|48,32)\]")
    mesh = make_mesh(8, 1, 1)
    ep = _collectives(cfg, mesh, "full_shard", EP)  # the dropless test's first mesh: its compile
    plain = _collectives(cfg, mesh, "full_shard")
    assert sum(op == "all-to-all" for op, _ in ep) >= 3, ep
    assert not [s for op, s in ep if op == "all-gather" and full_experts.search(s)], ep
    assert not [op for op, _ in plain if op == "all-to-all"]
    # routing runs per batch shard (models/moe_dispatch.py per_token_shard): the whole
    # batch's (128, 8) router logits are gathered nowhere for the top-k
    assert not [s for op, s in ep + plain if op == "all-gather" and s.startswith("f32[128,8]")]
    assert len([s for op, s in plain if op == "all-gather" and full_experts.search(s)]) >= 3, plain


def test_expert_parallelism_bad_input_is_one_line_exit_2(tmp_path, capsys):
    run = tmp_path / "run"
    base = ["--config", "configs/tiny.yaml", *TINY_RUN_OVERRIDES, f"run_dir={run}", "train.steps=1"]
    moe = ["model.n_experts=6", "model.experts_per_token=2", "model.moe_ffn_dim=32", "mesh.data=4", "mesh.fsdp=2"]
    rc, _, err = call("train", *base, *moe, "mesh.rules.expert=data", capsys=capsys)
    one_line(rc, err, "model.n_experts", "6", "data", "size 4")
    rc, _, err = call("train", *base, *moe, "model.n_experts=8", "mesh.rules.expert=[data,tensor]", capsys=capsys)
    one_line(rc, err, "mesh.rules.expert", "tensor")
    assert not run.exists()


def test_expert_axes_half_in_the_batch_are_refused():
    """Experts over (data, tensor): data shards the tokens, tensor replicates them; one
    layer cannot do both (ValueError, one line; the config check refuses it first)."""
    cfg = _cfg()
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    rules = {**DEFAULT_RULES, "expert": ("data", "tensor")}
    built = build(m, optax.sgd(0.1), make_mesh(4, 1, 2), "full_shard", rules=rules, min_shard_size=0)
    with (
        sharding_context(built.plan),
        pytest.raises(ValueError, match="the expert axes must be all batch axes"),
    ):
        jax.eval_shape(m.apply, built.abstract_state.params, jnp.zeros((8, 8), jnp.int32))


@pytest.mark.slow
@pytest.mark.parametrize("rule, data, fsdp", [("data", 8, 1), ("fsdp", 2, 4)])
def test_train_command_runs_expert_parallel(tmp_path, corpus, capsys, rule, data, fsdp):
    """`fsdp-jax train` with `mesh.rules.expert=data` (and `=fsdp`, tests/test_moe_ep_fsdp.py):
    the config passes its checks, the step runs, and metrics.jsonl carries the router metrics
    of every expert (the loads over the 8 experts sum to 1, so min <= 1/8 <= max)."""
    import json

    run = tmp_path / "run"
    moe = ["model.n_experts=8", "model.experts_per_token=2", "model.moe_ffn_dim=32", f"mesh.data={data}"]
    args = [
        "--config",
        "configs/tiny.yaml",
        *TINY_RUN_OVERRIDES,
        *moe,
        f"mesh.fsdp={fsdp}",
        f"mesh.rules.expert={rule}",
    ]
    rc, _, err = call("train", *args, f"data.path={corpus}", f"run_dir={run}", "train.steps=2", capsys=capsys)
    assert rc == 0, err[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in recs if "expert_load_min" in r][-1]
    assert np.isfinite(last["loss"]) and last["dropped_tokens"] == 0
    assert last["expert_load_min"] <= 1 / 8 <= last["expert_load_max"]
