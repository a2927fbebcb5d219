"""The configurable decoder (fsdp_jax.app.models.decoder + rope): the Llama-2 reference is
unchanged at the defaults, the family switches add exactly their params, and bad
switch values are one ConfigError naming the key. Logit parity with transformers per
family is in tests/test_hf.py (goldens written by transformers itself)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.models import Decoder, DecoderConfig, count_params, flops_per_token
from fsdp_jax.app.models.rope import inv_freq
from fsdp_jax.checkpoint import tree_paths
from fsdp_jax.errors import ConfigError
from fsdp_jax.model.fns import from_nnx

TINY = DecoderConfig(vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=48, max_seq_len=32)
GEMMA = dataclasses.replace(
    TINY,
    kv_channels=16,
    qk_norm=True,
    sliding_window=4,
    global_every=2,
    rope_local_theta=100.0,
    query_pre_attn_scalar=24.0,
    mlp_activation="gelu_pytorch_tanh",
    norm_plus_one=True,
    sandwich_norm=True,
    embed_scale=True,
    final_softcap=5.0,
    tie_word_embeddings=True,
    rope_type="linear",
    rope_factor=4.0,
)


def params_of(cfg):
    """The model and its params, initialised by one compiled program (eagerly, one per op)."""
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    return m, jax.jit(m.init)(jax.random.key(0))


def shapes_of(cfg):
    """The model and its init's params as shapes (`jax.eval_shape` of `init`: the tree and every
    leaf's shape, no program compiled), for the tests that read paths and sizes only."""
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    return m, jax.eval_shape(m.init, jax.random.key(0))


def logits(m, p, tok) -> np.ndarray:
    """m's forward compiled whole (every model of a comparison alike), not op by op."""
    return np.asarray(jax.jit(m.apply)(p, tok))


def test_defaults_are_the_llama2_reference_param_for_param():
    _, p = shapes_of(TINY)
    assert sorted(tree_paths(p)) == sorted(
        ["embed", "head", "final_norm/scale"]
        + [
            f"blocks/{k}"
            for k in (
                "attn/wq",
                "attn/wk",
                "attn/wv",
                "attn/wo",
                "mlp/w_gate",
                "mlp/w_up",
                "mlp/w_down",
                "attn_norm/scale",
                "mlp_norm/scale",
            )
        ]
    )
    # the planner's numbers for existing configs: PaLM's formula with D = H x Dh
    cfg = load_config("configs/llama2_7b.yaml").model
    assert flops_per_token(cfg, 4096) == 6.0 * (count_params(cfg) - 32000 * 4096) + 6.0 * 32 * 4096 * 4096


@pytest.mark.parametrize(
    "switches, new",
    [
        (dict(qkv_bias=True), {"blocks/attn/bq", "blocks/attn/bk", "blocks/attn/bv"}),
        (dict(qk_norm=True), {"blocks/attn/q_norm/scale", "blocks/attn/k_norm/scale"}),
        (dict(sandwich_norm=True), {"blocks/post_attn_norm/scale", "blocks/post_mlp_norm/scale"}),
        (dict(kv_channels=24, sliding_window=4, global_every=3, attn_softcap=30.0), set()),
    ],
)
def test_switches_add_exactly_their_params_and_count_params_counts_them(switches, new):
    cfg = dataclasses.replace(TINY, **switches)
    m, p = shapes_of(cfg)
    assert set(tree_paths(p)) - set(tree_paths(shapes_of(TINY)[1])) == new
    assert count_params(cfg) == sum(x.size for x in jax.tree.leaves(p))
    names = jax.tree.leaves(m.logical_axes, is_leaf=lambda x: isinstance(x, tuple))
    assert all(isinstance(n, str) for ax in names for n in ax if n is not None)  # logical names


def test_soft_capped_attention_equals_plain_attention_when_the_cap_is_far():
    """The capped path (its own grouped-query einsums, window mask, f32 softmax) against
    jax.nn.dot_product_attention on the same params: a cap of 1e5 changes scores by <1e-9."""
    m, p = params_of(GEMMA)
    capped = from_nnx(lambda r: Decoder(dataclasses.replace(GEMMA, attn_softcap=1e5), rngs=r))
    tok = jnp.asarray(np.random.RandomState(0).randint(0, 64, (2, 20)))
    a, b = logits(m, p, tok), logits(capped, p, tok)
    assert np.abs(a - b).max() < 1e-5 and a.std() > 0.05
    hard = from_nnx(lambda r: Decoder(dataclasses.replace(GEMMA, attn_softcap=0.5), rngs=r))
    assert np.abs(logits(hard, p, tok) - a).max() > 1e-3  # and a near cap matters


def test_window_and_pattern_change_exactly_the_positions_they_should():
    """Logits at positions < window equal full causal attention's; later ones differ."""
    full = dataclasses.replace(TINY, n_layers=2)
    m, p = params_of(full)
    tok = jnp.asarray(np.random.RandomState(1).randint(0, 64, (1, 16)))
    ref = logits(m, p, tok)
    for switches in (dict(sliding_window=5), dict(sliding_window=5, global_every=2)):
        w = from_nnx(lambda r: Decoder(dataclasses.replace(full, **switches), rngs=r))
        got = logits(w, p, tok)
        assert np.abs(got[:, :5] - ref[:, :5]).max() < 1e-6, switches
        assert np.abs(got[:, 5:] - ref[:, 5:]).max(axis=-1).min() > 1e-6, switches


def test_sliding_windows_cut_the_attention_flops():
    cfg = dataclasses.replace(TINY, sliding_window=8)
    assert flops_per_token(cfg, 32) < flops_per_token(TINY, 32)
    assert flops_per_token(cfg, 8) == flops_per_token(TINY, 8)  # the window covers it all


def test_rope_inverse_frequencies():
    base = dataclasses.replace(TINY, rope_theta=500000.0, kv_channels=128)
    f0, s0 = inv_freq(base)
    assert s0 == 1.0 and np.allclose(f0, 1 / 500000.0 ** (np.arange(0, 128, 2) / 128), rtol=1e-6)
    f, _ = inv_freq(dataclasses.replace(base, rope_type="linear", rope_factor=8.0))
    assert np.allclose(f, f0 / 8)
    l3 = dataclasses.replace(base, rope_type="llama3", rope_factor=8.0, rope_original_max_len=8192)
    f, _ = inv_freq(l3)
    wavelen = 2 * np.pi / f0
    assert np.array_equal(f[wavelen < 8192 / 4], f0[wavelen < 8192 / 4])  # high frequencies kept
    assert np.allclose(f[wavelen > 8192], f0[wavelen > 8192] / 8)  # low ones divided
    y = dataclasses.replace(base, rope_type="yarn", rope_factor=4.0, rope_original_max_len=4096)
    f, scale = inv_freq(y)
    assert scale == pytest.approx(0.1 * np.log(4.0) + 1.0)
    assert f[0] == f0[0] and f[-1] == pytest.approx(f0[-1] / 4, rel=1e-6)


@pytest.mark.parametrize(
    "override, key",
    [
        ("model.rope_type=dynamic", "model.rope_type"),
        ("model.mlp_activation=relu", "model.mlp_activation"),
        ("model.global_every=6", "model.global_every"),  # a pattern without a window
        ("model.rope_local_theta=1e4", "model.rope_local_theta"),
        ("model.rope_type=llama3", "model.rope_original_max_len"),
        ("model.kv_channels=15", "model.kv_channels"),
        ("model.kv_channels=-2", "model.kv_channels"),
        ("model.sliding_window=-1", "model.sliding_window"),
        ("model.attn_softcap=-5", "model.attn_softcap"),
    ],
)
def test_bad_decoder_switches_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config("configs/tiny.yaml", [override])
    assert e.value.key == key and "\n" not in str(e.value)
