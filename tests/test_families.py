"""The model-family registry (fsdp_jax.app.models.families): what it holds, and a family
registered from inside a test alone: its checkpoint imports, exports and round-trips, and its
own block parts run in the decoder without a fork."""

import dataclasses
import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from fsdp_jax.app.config.parse import model_dict
from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.hf.config_in import model_config_from_hf
from fsdp_jax.app.hf.config_out import config_json, family_of
from fsdp_jax.app.hf.export import write_hf_dir
from fsdp_jax.app.hf.load import model_section_from_hf
from fsdp_jax.app.models import Decoder, DecoderConfig, families
from fsdp_jax.app.models.families import llama
from fsdp_jax.app.models.parts import BlockParts
from fsdp_jax.app.models.self_attention import Attention
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.checkpoint import tree_paths
from fsdp_jax.checkpoint.safetensors_io import write_safetensors
from fsdp_jax.errors import ConfigError
from fsdp_jax.model.fns import from_nnx

GOLDEN = Path(__file__).resolve().parent / "golden" / "hf"


def logits(m, params, tokens) -> np.ndarray:
    """m's forward compiled whole, every model of a comparison alike (eagerly, each op was a
    program of its own: 30-50 compiles per test)."""
    return np.asarray(jax.jit(m.apply)(params, tokens))


def test_registry_lists_each_family_once_in_order():
    assert families.model_types() == (
        "llama",
        "mistral",
        "qwen2",
        "qwen3",
        "gemma3_text",
        "mixtral",
        "qwen3_moe",
        "qwen2_moe",
        "gpt_oss",
        "deepseek_v3",
    )
    assert families.by_architecture("MistralForCausalLM").model_type == "mistral"  # its own, not llama's
    assert families.by_architecture("Qwen3MoeForCausalLM").model_type == "qwen3_moe"
    assert families.by_architecture("Nope") is None and families.by_model_type("nope") is None
    assert [f.model_type for f in families.families() if f.is_moe] == [
        "mixtral",
        "qwen3_moe",
        "qwen2_moe",
        "gpt_oss",
        "deepseek_v3",
    ]
    with pytest.raises(ValueError, match="already registered"):
        families.register(families.by_model_type("llama"))
    with pytest.raises(ValueError, match="windows"):
        families.Family("x", ("X",), windows="sometimes")


def test_weight_names_come_from_the_families_switches():
    names = families.weight_names(DecoderConfig(qkv_bias=True, sandwich_norm=True))
    assert names["attn/bq"] == ("self_attn.q_proj.bias", "bias")  # qwen2's
    assert names["mlp_norm/scale"] == ("pre_feedforward_layernorm.weight", "id")  # gemma3's, over llama's
    assert "attn/q_norm/scale" not in names
    moe = DecoderConfig(n_experts=4, experts_per_token=2, moe_ffn_dim=8)
    assert families.expert_names(moe) == ("block_sparse_moe", ("w1", "w3", "w2"))  # mixtral's
    assert families.expert_names(dataclasses.replace(moe, qk_norm=True)) == families.GENERIC_EXPERTS


def _toy_fields_in(raw, bad, get):
    if raw.get("toy_marker") is not True:
        raise bad("toy_marker", "a toy config.json says true")
    return {}


TOY = families.Family(
    "toy_llama",
    ("ToyLlamaForCausalLM",),
    defaults=llama.DEFAULTS,
    fields_in=_toy_fields_in,
    json_out=lambda cfg, base: {"toy_marker": True},
    weights={"": llama.LAYER_NAMES},
)


@pytest.fixture
def toy():
    families.register(TOY)
    yield TOY
    families.unregister(TOY.model_type)


def _toy_checkpoint(tmp_path) -> Path:
    """The golden tiny Llama (tests/golden/hf/llama_gqa) relabelled as the toy family."""
    d = tmp_path / "toy"
    shutil.copytree(GOLDEN / "llama_gqa", d)
    raw = json.loads((d / "config.json").read_text())
    raw.update(model_type="toy_llama", architectures=["ToyLlamaForCausalLM"], toy_marker=True)
    (d / "config.json").write_text(json.dumps(raw))
    return d


def test_a_family_registered_in_a_test_imports_and_exports_bit_exact(tmp_path, toy):
    src = _toy_checkpoint(tmp_path)
    raw = json.loads((src / "config.json").read_text())
    with pytest.raises(ConfigError, match="toy_marker"):  # its own key, read by its own module
        model_config_from_hf({**raw, "toy_marker": False})
    ckpt = hf.HFCheckpoint(src)
    cfg = ckpt.config
    assert cfg == model_config_from_hf(json.loads((GOLDEN / "llama_gqa" / "config.json").read_text()))
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    params = hf.load_params(ckpt, jax.eval_shape(m.init, jax.random.key(0)))
    assert family_of(cfg).model_type == "llama" and family_of(cfg, hint="toy_llama") is toy
    out = tmp_path / "out"
    leaves = {p: np.asarray(v) for p, v in tree_paths(params).items()}
    run_cfg = SimpleNamespace(model=cfg, init_from=f"hf:{src}")
    write_hf_dir(out, run_cfg, "toy_llama", {p: v.dtype for p, v in leaves.items()}, leaves.__getitem__)
    back = json.loads((out / "config.json").read_text())
    assert back["model_type"] == "toy_llama" and back["architectures"] == ["ToyLlamaForCausalLM"]
    assert back["toy_marker"] is True
    assert back == config_json(cfg, "float32", {}, hint="toy_llama") | {
        k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw
    }
    again = hf.HFCheckpoint(out)
    assert again.config == cfg and set(again.where) == set(ckpt.where)
    for name, f in ckpt.where.items():
        assert np.array_equal(f.read(name), again.where[name].read(name)), name


class ScaledAttention(Attention):
    """A toy attention variant: the decoder's, its output times a learned per-layer gain."""

    def __init__(self, cfg, rngs):
        super().__init__(cfg, rngs)
        self.gain = nnx.Param(jnp.full((1,), 2.0))

    def __call__(self, x, *args, **kw):
        return super().__call__(x, *args, **kw) * self.gain[...]


GAIN = dataclasses.replace(
    TOY,
    model_type="toy_gain",
    architectures=("ToyGainForCausalLM",),
    fields_in=None,
    json_out=lambda cfg, base: {},
    parts=BlockParts(ScaledAttention),
    part_weights=lambda cfg: {"attn/gain": ("self_attn.gain", "id", (1,))},  # what its part adds
)


@pytest.fixture
def toy_gain():
    families.register(GAIN)
    yield GAIN
    families.unregister(GAIN.model_type)


@pytest.mark.parametrize("scan", [True, False])
@pytest.mark.fast_cases("True")
def test_a_family_brings_its_own_attention_without_forking_the_decoder(scan, toy_gain):
    cfg = DecoderConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=2, n_kv_heads=2, ffn_dim=64, scan_layers=scan)
    plain = from_nnx(lambda r: Decoder(cfg, rngs=r))
    gained = trainer_model(dataclasses.replace(cfg, family="toy_gain"))  # the trainer's build, by the config alone
    assert toy_gain.parts.attention is ScaledAttention
    # init eagerly: its ops' programs are shared by both models (one init program each cost more)
    p0, p1 = plain.init(jax.random.key(0)), gained.init(jax.random.key(0))
    gains = {k: v for k, v in tree_paths(p1).items() if k.endswith("attn/gain")}
    assert sorted(gains) == (["blocks/attn/gain"] if scan else ["blocks/0/attn/gain", "blocks/1/attn/gain"])
    tokens = jnp.arange(16).reshape(2, 8) % 32
    want, got = logits(plain, p0, tokens), logits(gained, p1, tokens)
    assert not np.allclose(want, got, atol=1e-3)  # the family's attention runs
    ones = jax.tree.map_with_path(lambda path, v: jnp.ones_like(v) if "gain" in jax.tree_util.keystr(path) else v, p1)
    np.testing.assert_array_equal(logits(gained, ones, tokens), want)  # base params as drawn


def test_a_config_names_only_a_family_with_parts_of_its_own(toy_gain):
    with pytest.raises(ConfigError, match="model.family"):
        Decoder(DecoderConfig(family="llama"), rngs=nnx.Rngs(0))  # llama brings none
    assert "family" not in model_dict(DecoderConfig())  # every other model's config reads as before
    cfg = DecoderConfig(family="toy_gain")
    assert model_dict(cfg)["family"] == "toy_gain" and families.block_parts(cfg) == toy_gain.parts


def _gain_checkpoint(tmp_path) -> tuple[Path, dict]:
    """The golden tiny Llama relabelled as the gain family, with each layer's gain tensor."""
    d = tmp_path / "gain"
    shutil.copytree(GOLDEN / "llama_gqa", d)
    raw = json.loads((d / "config.json").read_text())
    raw.update(model_type="toy_gain", architectures=["ToyGainForCausalLM"])
    (d / "config.json").write_text(json.dumps(raw))
    gains = {f"model.layers.{i}.self_attn.gain": np.array([0.5 + i], ml_dtypes.bfloat16) for i in range(2)}
    write_safetensors(d / "gains.safetensors", [(k, v.shape, v.dtype) for k, v in gains.items()], gains.__getitem__)
    index = json.loads((d / "model.safetensors.index.json").read_text())
    index["weight_map"].update({k: "gains.safetensors" for k in gains})
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    return d, gains


@pytest.mark.parametrize("scan", [True, False])
def test_a_family_with_its_own_parts_round_trips_import_model_export(tmp_path, toy_gain, scan):
    src, gains = _gain_checkpoint(tmp_path)
    ckpt = hf.HFCheckpoint(src, base=DecoderConfig(scan_layers=scan))
    cfg = ckpt.config
    assert cfg.family == "toy_gain"  # the checkpoint decides
    section = model_section_from_hf({"init_from": f"hf:{src}"})["model"]
    assert section["family"] == "toy_gain"  # a run from it builds the family's blocks
    params = hf.load_params(ckpt, trainer_model(cfg).abstract_params)
    leaves = {p: np.asarray(v) for p, v in tree_paths(params).items()}
    got = (
        [leaves["blocks/attn/gain"][i] for i in range(2)]
        if scan
        else [leaves[f"blocks/{i}/attn/gain"] for i in range(2)]
    )
    np.testing.assert_array_equal(np.stack(got), np.stack(list(gains.values())).astype(np.float32))
    llama = hf.HFCheckpoint(GOLDEN / "llama_gqa", base=DecoderConfig(scan_layers=scan))
    plain = from_nnx(lambda r: Decoder(llama.config, rngs=r))
    tokens = jnp.arange(16).reshape(2, 8)
    want = logits(plain, hf.load_params(llama, plain.abstract_params), tokens)
    model = trainer_model(cfg)
    assert not np.allclose(logits(model, params, tokens), want, atol=1e-3)  # its attention runs
    ones = jax.tree.map_with_path(lambda p, v: jnp.ones_like(v) if "gain" in jax.tree_util.keystr(p) else v, params)
    np.testing.assert_array_equal(logits(model, ones, tokens), want)
    out = tmp_path / "out"
    run_cfg = SimpleNamespace(model=cfg, init_from=f"hf:{src}")
    write_hf_dir(out, run_cfg, None, {p: v.dtype for p, v in leaves.items()}, leaves.__getitem__, "bfloat16")
    back = json.loads((out / "config.json").read_text())
    assert back["model_type"] == "toy_gain" and back["architectures"] == ["ToyGainForCausalLM"]
    again = hf.HFCheckpoint(out, base=DecoderConfig(scan_layers=scan))
    assert again.config == cfg and set(again.where) == set(ckpt.where)
    for name, f in ckpt.where.items():
        assert np.array_equal(f.read(name), again.where[name].read(name)), name
