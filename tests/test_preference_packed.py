"""Packed preference pairs (`preference.packing`): several pairs per row, chosen and rejected of a
pair side by side, attention and positions per sequence (segment ids), log-probs summed per
segment. The loss, its gradients and every metric equal the unpacked batch of the same pairs
(TRL's padding-free DPO gives the padded batch's numbers); the step under full_shard equals one
device; the planner counts a packed row as one row."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fsdp_jax.app.objectives import (
    LOSSES,
    PreferenceSpec,
    finish_metrics,
    make_preference_loss,
    preference_terms,
    reference_logps,
    with_reference,
)
from fsdp_jax.app.objectives.preference_data import PairIds, collate
from fsdp_jax.app.objectives.preference_pack import max_pairs_for, pack_pairs
from fsdp_jax.app.objectives.preference_packed import packed_terms
from fsdp_jax.app.objectives.reference import pair_logits
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.errors import DataError
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from helpers import TINY

CFG = dataclasses.replace(TINY, max_seq_len=48)
LENGTH = 41  # tokens per row (data.seq_len + 1)
MAX_PAIRS = 4
SLOTS = 2 * MAX_PAIRS


def random_pairs(n=24, seed=0) -> list[PairIds]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        p = rng.integers(3, 256, rng.integers(2, 8)).tolist()
        c, r = (rng.integers(3, 256, rng.integers(1, 9)).tolist() for _ in range(2))
        out.append(PairIds(p, c, r))
    return out


@pytest.fixture(scope="module")
def data():
    arrays = collate(random_pairs(), LENGTH)
    packed = pack_pairs(arrays, MAX_PAIRS)
    order = packed.pairs[packed.pairs >= 0]  # the pairs in the rows, in row order: the unpacked batch
    return arrays, packed, {k: v[order] for k, v in arrays.items()}, packed.rows(np.arange(len(packed)))


def test_pairs_packed_whole_with_their_segments(data):
    arrays, packed, _, _ = data
    lengths = arrays["attention"].sum(-1)
    assert sorted(packed.pairs[packed.pairs >= 0].tolist()) == list(range(len(lengths)))  # every pair once
    assert len(packed) < len(lengths)  # fewer rows than pairs (2x fewer than unpacked rows, at least)
    for r in range(len(packed)):
        seg, at = packed.segment_ids[r], 0
        for k, i in enumerate(packed.pairs[r][packed.pairs[r] >= 0]):
            for side in (0, 1):  # chosen (2k + 1) then rejected (2k + 2), whole, in one row
                n = lengths[i, side]
                assert (seg[at : at + n] == 2 * k + side + 1).all()
                np.testing.assert_array_equal(packed.tokens[r, at : at + n], arrays["tokens"][i, side, :n])
                np.testing.assert_array_equal(packed.completion[r, at : at + n], arrays["completion"][i, side, :n])
                at += n
        assert (seg[at:] == 0).all()
    st = packed.stats
    assert st.real_tokens == lengths.sum() and st.row_tokens == len(packed) * LENGTH
    assert st.efficiency == pytest.approx(lengths.sum() / (len(packed) * LENGTH))
    assert max_pairs_for(128) == 63  # 2 segments a pair + padding within cuDNN's packed-layout bound


def test_pairs_per_row_capped_and_a_pair_longer_than_a_row_refused():
    arrays = collate([PairIds([5], [6], [7])] * 9, LENGTH)  # 4 tokens a pair: 10 would fit a row
    packed = pack_pairs(arrays, 3)
    assert (packed.pairs >= 0).sum(1).tolist() == [3, 3, 3]
    long = collate([PairIds([5] * 10, [6] * 12, [7] * 12)], LENGTH)  # 22 + 22 tokens > 41
    with pytest.raises(
        DataError, match=r"f.jsonl:3: the pair \(22 chosen \+ 22 rejected tokens\).*preference.max_length <= 20"
    ):
        pack_pairs(long, 3, ["f.jsonl:3"])


@pytest.fixture(scope="module")
def model_and_params():
    model = with_reference(trainer_model(CFG))
    return model, model.init(jax.random.key(0)), model.init(jax.random.key(1))  # policy != reference


@pytest.mark.slow
def test_every_loss_and_metric_equals_the_unpacked_batch(data, model_and_params):
    _, _, unpacked, packed = data
    model, params, ref = model_and_params
    specs = {
        loss: PreferenceSpec(loss, 0.5, 0.1 if loss in ("dpo", "simpo") else 0.0, cpo_alpha=0.3 * (loss == "simpo"))
        for loss in LOSSES
    }

    def all_losses(params, batch):  # one forward of each model, every loss on its logits
        logits = pair_logits(model, params, batch)
        ref_logps = reference_logps(model, ref, batch, SLOTS)
        out = {}
        for name, spec in specs.items():
            if "segment_ids" in batch:
                loss, aux = packed_terms(spec, logits, batch, SLOTS, ref_logps)
                out[name] = (loss.total / loss.count, aux)
            else:
                out[name] = preference_terms(spec, logits, batch, ref_logps)
        dpo = make_preference_loss(model, specs["dpo"], "state", slots=SLOTS)
        grads = jax.grad(
            lambda p: (lambda t: t.total / t.count if hasattr(t, "count") else t)(dpo(p, batch, ref)[0][0])
        )
        return out, grads(params)

    (a, ga), (b, gb) = (jax.device_get(jax.jit(all_losses)(params, x)) for x in (unpacked, packed))
    for name in specs:
        want = {"loss": float(a[name][0]), **finish_metrics([a[name][1]])}
        got = {"loss": float(b[name][0]), **finish_metrics([b[name][1]])}
        assert set(got) == set(want)
        for k, v in want.items():  # f32: 1e-6, relative for the log-prob sums (tens of nats)
            assert abs(got[k] - v) <= 1e-6 * max(1.0, abs(v)), (name, k, got[k], v)
        assert got["rewards/margins"] != 0.0  # a real reference: the comparison is not log 2 against log 2
    assert b["dpo"][1]["pairs"] == len(unpacked["tokens"])
    for x, y in zip(jax.tree.leaves(ga), jax.tree.leaves(gb)):
        np.testing.assert_allclose(y, x, rtol=0, atol=1e-6)


def _steps(batch, strategy, shape, microbatches=1, steps=2):
    model = with_reference(trainer_model(CFG))
    mesh = make_mesh(*shape, devices=jax.devices()[: int(np.prod(shape))])
    loss_fn = make_preference_loss(model, PreferenceSpec("dpo", 0.5), "state", slots=SLOTS)
    built = build(
        model,
        optax.adamw(3e-3),
        mesh,
        strategy,
        loss_fn=loss_fn,
        has_aux=True,
        min_shard_size=0,
        microbatches=microbatches,
    )
    state, out = built.init_state(jax.random.key(0)), []
    for _ in range(steps):
        state, m = built.train_step(state, batch)
        out.append({"loss": float(m["loss"]), **finish_metrics([jax.device_get(m["aux"])])})
    return out


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy, shape",
    [("full_shard", (1, 4, 1)), ("shard_grad_op", (1, 4, 1)), ("shard_opt", (1, 4, 1)), ("hybrid_shard", (2, 2, 1))],
)
def test_packed_step_every_strategy_with_microbatches_equals_one_device_unpacked(data, strategy, shape):
    """4 devices, 2 microbatches of packed rows (different pair counts each) against one device on
    the unpacked pairs: the TokenSum over pairs averages exactly."""
    arrays, pk, _, packed = data
    rows = {k: v[:8] for k, v in packed.items()}  # 8 rows (2 microbatches x 4 devices), their pairs unpacked
    order = pk.pairs[:8][pk.pairs[:8] >= 0]
    unp = {k: v[order] for k, v in arrays.items()}
    one = _steps(unp, "no_shard", (1, 1, 1), steps=3)
    full = _steps(rows, strategy, shape, microbatches=2, steps=3)
    assert one[-1]["rewards/margins"] > 0
    for step, (a, b) in enumerate(zip(one, full)):
        for k in a:
            if step == 0 and k == "rewards/accuracies":  # policy == reference: margins are ties (ulps) at step 1
                assert abs(a["rewards/margins"]) < 1e-6 and abs(b["rewards/margins"]) < 1e-6
                continue
            assert abs(a[k] - b[k]) < 2e-5 * max(1.0, abs(a[k])), (strategy, step, k, a[k], b[k])


def test_planner_counts_a_packed_row_as_one_row():
    """16 packed rows cost what 16 unpacked rows (8 pairs) cost in the step-time model, and the
    planned batch is (B, S + 1) rows with segment ids, the precomputed reference per slot."""
    from fsdp_jax.app.planner.abstract_step import abstract_batch
    from fsdp_jax.app.planner.step_time import predict_roofline, step_rows
    from fsdp_jax.app.trainer.setup import load_run_config

    packed = load_run_config("configs/dpo_tiny.yaml", ["preference.packing=true"])
    pairs = load_run_config("configs/dpo_tiny.yaml", ["train.global_batch=8"])
    assert step_rows(packed) == 1 and step_rows(pairs) == 2
    result = {"analytic": {"grads": 0, "params": 0, "optimizer": 0}, "communication": {}}
    p, u = predict_roofline(packed, "h100", 8, result), predict_roofline(pairs, "h100", 8, result)
    assert p["compute_s"] == pytest.approx(u["compute_s"], rel=1e-9)
    assert p["tokens_per_s_per_gpu"] == pytest.approx(u["tokens_per_s_per_gpu"], rel=1e-9)
    pre = dataclasses.replace(packed, preference=dataclasses.replace(packed.preference, precompute_ref_log_probs=True))
    b = abstract_batch(pre, None)
    s = packed.data.seq_len + 1
    assert {k: v.shape for k, v in b.items()} == {
        "tokens": (16, s),
        "completion": (16, s),
        "segment_ids": (16, s),
        "ref_logps": (16, 2 * max_pairs_for(packed.model.max_segments)),
    }
    assert jnp.dtype(b["segment_ids"].dtype) == jnp.int32
