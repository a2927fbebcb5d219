"""`plan` on a GRPO config (issue 58 item 6): the training step on prompt + completion rows
and, on the same mesh, the generation's prefill and decode step with the KV cache in the
memory model; on a target, the step's time split between generation and training. What
GRPO does not support (offload, mesh.context > 1, several hosts) is refused in one line."""

from __future__ import annotations

import json
import re
import types

import numpy as np
import pytest

from helpers import ROOT, call, one_line

CONFIG = ROOT / "configs" / "grpo_tiny.yaml"
# a reference in model state (beta > 0) and the sampling policy's log-probs (num_iterations 2)
OVERRIDES = ["init_from=null", "grpo.beta=0.04", "grpo.num_iterations=2"]


@pytest.fixture(scope="module")
def planned():
    """(config, the plan document) of full_shard on this process's 8 CPU devices."""
    from fsdp_jax.app.planner.estimate import plan_config
    from fsdp_jax.app.trainer.setup import load_run_config

    cfg = load_run_config(CONFIG, OVERRIDES)
    return cfg, plan_config(cfg, 8, ["full_shard"], device_memory=10**9)


@pytest.mark.slow
def test_generation_memory_counts_the_kv_cache(planned):
    cfg, doc = planned
    r = doc["strategies"]["full_shard"]
    g, a, m = r["grpo"], r["analytic"], cfg.model
    rows = cfg.train.global_batch // 8  # the cache's batch dim over data x fsdp
    p, n = cfg.grpo.max_prompt_len, cfg.grpo.max_new_tokens
    kv = 2 * m.n_layers * rows * (p + n) * m.n_kv_heads * m.head_dim * 4  # k and v, f32 compute
    assert g["kv_cache"] == kv
    dec = g["decode_step"]
    assert dec["alias"] == kv  # the donated cache is written in place: exactly its bytes aliased
    extra = dec["argument"] - a["params"] - kv  # the rest: last logits (rows, V) f32, start, done, index, key
    assert 0 <= extra <= rows * (m.vocab_size * 4 + 8) + 64, extra
    assert g["prefill"]["output"] >= kv  # the prefill returns the filled cache
    # resident through generation: the optimizer state and the frozen reference (model state)
    assert 0 <= g["resident"] - a["optimizer"] <= 8, (g["resident"], a["optimizer"])
    assert g["peak"] == max(g["prefill"]["peak"], dec["peak"]) + g["resident"]
    assert g["step_peak"] == max(g["peak"], r["compiled"]["device_peak"])
    assert r["fits"] is (g["step_peak"] <= 10**9)


@pytest.mark.slow
def test_training_step_takes_the_grpo_rows(planned):
    cfg, doc = planned
    r = doc["strategies"]["full_shard"]
    a, c = r["analytic"], r["compiled"]
    p, n = cfg.grpo.max_prompt_len, cfg.grpo.max_new_tokens
    # tokens (P + N), prompt_len, completion, completion_mask, old_logps (N each), advantages: 4 bytes each
    per_row = 4 * ((p + n) + 1 + 3 * n + 1)
    assert a["batch"] == cfg.train.global_batch // 8 * per_row
    assert a["params"] + a["optimizer"] < c["argument"] <= a["params"] + a["optimizer"] + a["batch"]
    assert "seq 14" in doc["notes"][0]  # rows of P + N = 14 model inputs


@pytest.mark.slow
def test_plan_table_shows_the_grpo_step(planned):
    from fsdp_jax.app.planner.report import format_table

    text = format_table(planned[1])
    assert "GRPO step: generation of 6 tokens after 8-token prompts for 64 rows" in text
    line = next(li for li in text.splitlines() if li.startswith("full_shard") and len(li.split()) == 8)
    kv = planned[1]["strategies"]["full_shard"]["grpo"]["kv_cache"]
    assert float(line.split()[1]) == pytest.approx(kv / 1e3, abs=0.01)  # KB


@pytest.mark.slow
def test_h100_plan_splits_generation_and_training(capsys):
    rc, out, err = call(
        "plan", "--config", CONFIG, "--target", "h100", "--devices", "8", "--strategies", "full_shard", "--json",
        *OVERRIDES, capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err[-3000:]
    r = json.loads(out)["strategies"]["full_shard"]
    s, step = r["predicted"]["grpo"], r["predicted"]["step_s"]
    assert s["generation_s"] == pytest.approx(s["prefill_s"] + 6 * s["decode_step_s"], rel=1e-3)
    assert s["training_s"] == pytest.approx(2 * step, rel=1e-3)  # num_iterations optimizer steps
    assert s["step_s"] == pytest.approx(s["generation_s"] + s["training_s"], rel=1e-3)
    assert s["generation_fraction"] + s["training_fraction"] == pytest.approx(1.0, abs=1e-3)
    # the decode step gathers each layer's params inside the layer loop (ZeRO-3): runs = layers
    gathers = [o for o in r["grpo"]["decode_step"]["op_inventory"] if o["kind"] == "collective"]
    assert any(o["op"] == "all-gather" and o["runs"] == 2 for o in gathers), gathers
    assert r["grpo"]["decode_step"]["alias"] == r["grpo"]["kv_cache"]
    # the cache fusions (XLA:GPU: `dynamic-update-slice(bitcast(param), ...)` roots, and the layer
    # sliced out of the just-updated cache) move the token's slot and one layer, not the cache
    # (fsdp_jax.hlo.fusion_bytes: 30,728 and 44,072 bytes when the bitcast hid the in-place update)
    rows, m = 64 // 8, types.SimpleNamespace(k=2, dh=16, s=14, layers=2)
    slot, layer = rows * m.k * m.dh * 4, rows * m.k * m.dh * m.s * 4  # f32, per GPU
    mem = [o for o in r["grpo"]["decode_step"]["op_inventory"] if o["kind"] == "memory"]
    updates = [o for o in mem if o["op_name"].endswith("/dynamic_update_slice")]
    assert len(updates) == 2 and all(o["bytes"] <= 2 * slot + 64 for o in updates), updates
    assert r["grpo"]["kv_cache"] == 2 * m.layers * layer
    # the layer's k, v (op_name `.../closed_call/jit(dynamic_index_in_dim)/...` on jax 0.10,
    # `.../eval_jaxpr/jit(dynamic_index_in_dim)/...` on 0.12) and the token's slots: one on jax 0.10,
    # its k and v slots on 0.12 (29,736 and 29,704 bytes); the whole cache would be 2 * layers * layer
    reads = [o for o in mem if re.search(r"(closed_call|eval_jaxpr)/jit\(dynamic_index_in_dim\)", o["op_name"])]
    assert len(reads) == 2 and all(o["bytes"] <= 2 * layer + 2 * slot + 64 for o in reads), reads


@pytest.mark.parametrize(
    "extra, words",
    [
        (["offload=optimizer"], ["offload", "'optimizer'", "objective grpo does not support"]),
        (["mesh.context=2"], ["mesh.context", "objective grpo does not support"]),
        (["grpo.num_generations=1"], ["grpo.num_generations", ">= 2"]),
        (["grpo.max_new_tokens=30"], ["grpo.max_new_tokens", "model.max_seq_len=32"]),
    ],
)
def test_plan_refuses_what_grpo_does_not_support(capsys, extra, words):
    rc, _, err = call("plan", "--config", CONFIG, "--devices", "8", "init_from=null", *extra, capsys=capsys)
    one_line(rc, err, *words)


def test_plan_search_refuses_grpo(capsys):
    args = ["--devices", "8", "--device-memory", "1GB", "--search", "init_from=null"]
    rc, _, err = call("plan", "--config", CONFIG, *args, capsys=capsys)
    one_line(rc, err, "--search", "objective=grpo", "without --search")


def test_plan_refuses_grpo_over_several_hosts(capsys):
    args = ["--target", "h100", "--devices", "16", "--hosts", "2", "init_from=null"]
    rc, _, err = call("plan", "--config", CONFIG, *args, capsys=capsys)
    one_line(rc, err, "distributed", "2 processes", "objective grpo does not support")


def test_abstract_batch_is_the_trainers():
    """The planner's GRPO batch has the shapes and dtypes of the batch the trainer feeds."""
    from fsdp_jax.app.objectives.grpo_run import GrpoBatches
    from fsdp_jax.app.planner.grpo_plan import abstract_grpo_batch
    from fsdp_jax.app.trainer.setup import load_run_config

    cfg = load_run_config(CONFIG, OVERRIDES)
    sizes = types.SimpleNamespace(rows=64, p=8, n=6, old_logps=object())  # what GrpoBatches.batch reads
    trainer = GrpoBatches.batch(sizes, 0)  # the trainer's zero batch of the right shapes
    planned = abstract_grpo_batch(cfg, None)
    assert {k: (v.shape, np.dtype(v.dtype)) for k, v in planned.items()} == {
        k: (v.shape, v.dtype) for k, v in trainer.items()
    }
