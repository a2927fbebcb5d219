"""Generation with a KV cache (models/generate.py, models/kv_cache.py): the logits each token
is drawn from equal the full forward's on the same unpadded prefix, for every attention
option of the decoder, on one device and sharded over 8 devices (full_shard); stop tokens,
greedy, top-k and top-p."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fsdp_jax.app.models.generate import SamplingSpec, generate, left_pad, sample_logits
from fsdp_jax.app.objectives.rollout import make_sampler
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from helpers import TINY

ROWS = [[5, 6, 7, 8, 9, 10, 11], [12, 13], [14, 15, 16, 17], [18], [19, 20, 21], [22, 23, 24, 25, 26], [27, 28], [29]]
SPEC = SamplingSpec(max_new_tokens=9, temperature=1.0, top_k=40, top_p=0.95)
VARIANTS = {
    # Gemma 3-like: sliding layers on a pattern with their own RoPE base, soft caps, q/k norms,
    # sandwich norms, tied head, scaled embeddings, query_pre_attn_scalar
    "gemma": dict(
        n_layers=4,
        sliding_window=4,
        global_every=2,
        attn_softcap=20.0,
        final_softcap=30.0,
        qk_norm=True,
        norm_plus_one=True,
        sandwich_norm=True,
        embed_scale=True,
        rope_local_theta=100.0,
        mlp_activation="gelu_pytorch_tanh",
        tie_word_embeddings=True,
        query_pre_attn_scalar=24.0,
    ),
    # MoE every second layer (two-layer scan groups), q/k/v biases
    "moe": dict(n_layers=4, n_experts=4, experts_per_token=2, moe_ffn_dim=32, decoder_sparse_step=2, qkv_bias=True),
    # unscanned layers, a window on every layer, llama3 RoPE scaling
    "unscanned": dict(
        scan_layers=False, sliding_window=5, rope_type="llama3", rope_factor=8.0, rope_original_max_len=16
    ),
}


def sharpened(params, factor=4.0):
    """Params scaled up so attention and the next-token distribution are far from uniform
    (at init N(0, 0.02) every row's logits are nearly equal and a wrong mask would hide)."""
    return jax.tree.map(lambda x: x * factor, params)


def full_logits(model, params, rows, tokens) -> np.ndarray:
    """The plain forward over each unpadded prompt + its sampled tokens (right-padded rows)."""
    n = tokens.shape[1]
    full = np.zeros((len(rows), max(map(len, rows)) + n), np.int32)
    for b, r in enumerate(rows):
        full[b, : len(r) + n] = list(r) + tokens[b].tolist()
    # one compiled forward (eager, its ops compiled one tiny program each: 20-70 per case)
    return np.asarray(jax.jit(model.apply)(params, jnp.asarray(full)))


def step_errors(model, params, rows, out) -> float:
    """Largest difference between a decode step's logits and the full forward's, relative
    to the largest logit (f32 rounding of different summation orders: ~1e-6)."""
    lg = full_logits(model, params, rows, out["tokens"])
    errs = [
        np.abs(lg[b, len(r) - 1 + i] - out["logits"][b, i]).max()
        for b, r in enumerate(rows)
        for i in range(out["lengths"][b])
    ]
    return float(max(errs)) / max(1.0, float(np.abs(out["logits"]).max()))


def run_one_device(cfg, spec=SPEC, rows=ROWS, seed=1):
    model = trainer_model(cfg)
    params = jax.jit(lambda k: sharpened(model.init(k)))(jax.random.key(0))  # one program, not one per op
    prompts, lengths = left_pad(rows)
    fn = jax.jit(lambda p, pr, ln, k: generate(model.bind(p), pr, ln, k, spec, return_logits=True))
    return model, params, jax.device_get(fn(params, prompts, lengths, jax.random.key(seed)))


@pytest.fixture(scope="module")
def tiny_one():
    return run_one_device(TINY)


def test_decode_logits_equal_full_forward_tiny(tiny_one):
    model, params, out = tiny_one
    assert out["tokens"].shape == (len(ROWS), SPEC.max_new_tokens)
    assert (out["lengths"] == SPEC.max_new_tokens).all()
    assert step_errors(model, params, ROWS, out) < 5e-6
    # the logits are far from uniform, so a wrong mask or position would show
    assert np.ptp(out["logits"][0, 0]) > 1.0


def test_prompt_padding_does_not_change_a_row(tiny_one):
    """Row 1 generated alone (no padding) equals row 1 of the padded batch."""
    model, params, out = tiny_one
    prompts, lengths = left_pad([ROWS[1]])
    fn = jax.jit(lambda p, pr, ln, k: generate(model.bind(p), pr, ln, k, SPEC, return_logits=True))
    alone = jax.device_get(fn(params, prompts, lengths, jax.random.key(5)))
    np.testing.assert_allclose(alone["logits"][0, 0], out["logits"][1, 0], atol=2e-5)


@pytest.mark.slow
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_decode_logits_equal_full_forward_variants(variant):
    cfg = dataclasses.replace(TINY, **VARIANTS[variant])
    model, params, out = run_one_device(cfg)
    assert step_errors(model, params, ROWS, out) < 5e-6


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["tiny", "moe"])
def test_full_shard_8_devices_equals_one_device(tiny_one, variant):
    if variant == "tiny":
        model, params, out = tiny_one
    else:  # the experts' dispatch per batch shard, one token per row per step
        model, params, out = run_one_device(dataclasses.replace(TINY, **VARIANTS[variant]))
    mesh = make_mesh(1, 8, devices=jax.devices()[:8])
    built = build(model, optax.sgd(0.1), mesh, "full_shard", min_shard_size=0)
    sharded = jax.device_put(params, built.plan.params)
    assert any(
        len(x.sharding.device_set) == 8 and x.addressable_shards[0].data.size < x.size for x in jax.tree.leaves(sharded)
    )
    sample = make_sampler(model, built.plan, SPEC, return_logits=True)
    prompts, lengths = left_pad(ROWS)
    got = jax.device_get(sample(sharded, prompts, lengths, jax.random.key(1)))
    np.testing.assert_array_equal(got["tokens"], out["tokens"])
    np.testing.assert_allclose(got["logits"], out["logits"], atol=5e-6 * max(1.0, float(np.abs(out["logits"]).max())))
    assert step_errors(model, params, ROWS, got) < 5e-6


def test_stop_tokens_end_rows_and_pad():
    spec = dataclasses.replace(SPEC, temperature=0.0)
    model, params, greedy = run_one_device(TINY, spec, ROWS[:2])
    stop = int(greedy["tokens"][0, 3])
    first = [int(np.argmax(r == stop)) + 1 if (r == stop).any() else spec.max_new_tokens for r in greedy["tokens"]]
    _, _, out = run_one_device(TINY, dataclasses.replace(spec, stop_tokens=(stop,), pad_id=255), ROWS[:2])
    assert out["lengths"].tolist() == first
    assert first[0] <= 4
    for b, n in enumerate(first):
        np.testing.assert_array_equal(out["tokens"][b, :n], greedy["tokens"][b, :n])
        assert (out["tokens"][b, n:] == 255).all()


def test_sampling_filters():
    logits = jnp.asarray(np.random.default_rng(0).normal(size=(4, 50)) * 3, jnp.float32)
    keys = jax.random.split(jax.random.key(0), 200)
    greedy = np.argmax(np.asarray(logits), -1)
    draw = jax.jit(jax.vmap(lambda k, s=None: sample_logits(logits, k, s), in_axes=(0, None)), static_argnums=1)
    top2 = np.sort(np.asarray(logits), -1)[:, -2:]
    got = np.asarray(draw(keys, SamplingSpec(top_k=2)))  # (200, 4)
    picked = np.take_along_axis(np.asarray(logits)[None].repeat(200, 0), got[..., None], -1)[..., 0]
    assert np.isin(picked, top2).all() and (got != greedy).any()
    np.testing.assert_array_equal(np.asarray(draw(keys, SamplingSpec(top_p=1e-6)))[0], greedy)
    np.testing.assert_array_equal(np.asarray(draw(keys, SamplingSpec(temperature=0.0)))[0], greedy)
    p = np.asarray(jax.jit(jax.nn.softmax)(np.asarray(logits)[0]))  # one program (eagerly, one per op)
    kept = p >= np.sort(p)[::-1][np.searchsorted(np.cumsum(np.sort(p)[::-1]), 0.5)]
    got_p = np.asarray(draw(keys, SamplingSpec(top_p=0.5)))[:, 0]
    assert kept[got_p].all()
    assert len(set(got_p.tolist())) > 1 or kept.sum() == 1
