"""gpt-oss (families/gpt_oss.py: models/sinks.py, models/moe_clamped.py, app/hf/mxfp4.py)
against transformers' own GptOssForCausalLM (tests/golden/make_hf_gpt_oss_goldens.py): logits,
the experts each token's router chooses, the aux loss; every strategy and expert parallelism;
export round trips; LoRA by PEFT names; bad config.json keys.

Goldens: gpt_oss (float32) and gpt_oss_mxfp4 (its experts stored as MXFP4 blocks / scales,
transformers' dequantisation), 4 layers alternating sliding (window 8) / full, 2 x 40 tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import optax
import pytest
from flax import nnx
from test_hf import GOLDEN, MESHES, index_and_shapes, saved_run

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.hf import peft
from fsdp_jax.app.hf.config_in import model_config_from_hf
from fsdp_jax.app.hf.export import export_hf
from fsdp_jax.app.models import Decoder, DecoderConfig, count_params, families, lora_problems
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models import moe as moe_lib
from fsdp_jax.app.models.moe_clamped import ClampedMoE
from fsdp_jax.app.models.sinks import SinkAttention
from fsdp_jax.app.trainer.build import make_loss_fn
from fsdp_jax.checkpoint import CheckpointError
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from fsdp_jax.errors import ConfigError
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rule_table import DEFAULT_RULES
from fsdp_jax.train.build import build
from fsdp_jax.train.step import sharding_context
from helpers import call, one_line

NAMES = ("gpt_oss", "gpt_oss_mxfp4")


def golden(name):
    f = SafetensorsFile(GOLDEN / f"{name}_logits.safetensors")
    return {k: f.read(k) for k in f.tensors}


def imported(path, strategy="full_shard", mesh_shape=(1, 8, 1), scan=True, rules=None):
    ckpt = hf.HFCheckpoint(path, base=DecoderConfig(scan_layers=scan))
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    built = build(m, optax.sgd(0.1), make_mesh(*mesh_shape), strategy, min_shard_size=0, rules=rules)
    return hf.load_params(ckpt, built.abstract_state.params), m, built.plan, ckpt.config


def check(name, **kw):
    """Logits within 1e-4 and the aux loss within 1e-5 of transformers'; (params, cfg)."""
    g = golden(name)
    params, m, plan, cfg = imported(GOLDEN / name, **kw)
    t = jnp.asarray(np.tile(g["tokens"], (4, 1)))  # 8 rows: every batch sharding divides
    with sharding_context(plan):
        logits, stats = jax.jit(lambda p, t: m.apply(p, t, router=True))(params, t)
    err = float(np.abs(np.asarray(logits)[:2] - g["logits"]).max())
    assert err < 1e-4, (name, kw, err)
    assert abs(float(moe_lib.aux_loss(stats)) - float(g["aux_loss"])) < 1e-5, (name, kw)
    return params, cfg


@pytest.fixture(scope="module", params=NAMES)
def full_shard(request):
    return request.param, *check(request.param)


def test_import_matches_transformers_logits_and_aux_loss(full_shard):
    name, params, cfg = full_shard
    assert cfg.family == "gpt_oss" and cfg.global_every == 2 and cfg.sliding_window == 8
    assert cfg.swiglu_limit == 1.0 and cfg.rope_type == "yarn" and not cfg.rope_truncate
    layer = params["segments"][0]["layers"]  # one segment: groups of a sliding and a full layer
    assert set(layer) == {"0", "1"} or set(layer) == {0, 1}
    attn, moe = layer[0]["attn"], layer[0]["moe"]
    assert attn["sinks"].shape == (2, 4) and attn["bo"].shape == (2, 96)
    assert moe["w_gate_up"].shape == (2, 4, 96, 64) and moe["router_bias"].shape == (2, 4)
    assert moe["w_gate_up"].sharding.spec == jax.sharding.PartitionSpec(None, None, "fsdp", None)
    assert count_params(cfg) == sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    per_expert = 3 * 96 * 32 + 2 * 32 + 96  # weights and biases
    assert count_params(cfg) - count_params(cfg, active=True) == 4 * (4 - 2) * per_expert


def _router_logits(name):
    """Our per-layer router logits (80, E), from an unscanned model's forward (no mesh), jitted:
    one compile, not one per op of an eager forward (~90 compiles per golden)."""
    ckpt = hf.HFCheckpoint(GOLDEN / name, base=DecoderConfig(scan_layers=False))
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    params = hf.load_params(ckpt, m.abstract_params)
    plain = ClampedMoE.router_logits

    def forward(p, tokens):
        seen = []

        def record(self, x2):
            out = plain(self, x2)
            seen.append(out)
            return out

        ClampedMoE.router_logits = record
        try:
            m.apply(p, tokens)
        finally:
            ClampedMoE.router_logits = plain
        return seen

    return [np.asarray(x) for x in jax.jit(forward)(params, jnp.asarray(golden(name)["tokens"]))]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.fast_cases("gpt_oss_mxfp4")
def test_router_chooses_the_experts_transformers_chooses(name):
    g, ours = golden(name), _router_logits(name)
    assert len(ours) == 4
    for i, lg in enumerate(ours):
        theirs = g[f"router_logits_{i}"]  # bias included, before the top-k
        assert float(np.abs(lg - theirs).max()) < 1e-4, i
        pick = lambda z: np.sort(np.argsort(-z, axis=-1, kind="stable")[:, :2], axis=-1)  # noqa: E731
        assert np.array_equal(pick(lg), pick(theirs)), i  # the same 2 experts for every token


@pytest.mark.slow
def test_unscanned_fsdp_x_tensor_and_expert_parallel_match_transformers():
    for name in NAMES:
        check(name, scan=False, mesh_shape=(1, 4, 2))
    params, _ = check("gpt_oss", mesh_shape=(1, 4, 2), rules={**DEFAULT_RULES, "expert": "tensor"})
    leaf = params["segments"][0]["layers"][1]["moe"]["b_down"]  # (groups, expert, embed)
    assert leaf.sharding.spec[1] == "tensor" and leaf.addressable_shards[0].data.shape[1] == 2


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in MESHES if s != "full_shard"])
@pytest.mark.parametrize("name", NAMES)
def test_import_matches_transformers_every_strategy(name, strategy):
    check(name, strategy=strategy, mesh_shape=MESHES[strategy])


@pytest.mark.slow
def test_export_round_trips_bit_exact_and_writes_the_published_layout(tmp_path):
    ck, params = saved_run(tmp_path, "gpt_oss")
    out = tmp_path / "hf_out"
    export_hf(ck, out)
    assert index_and_shapes(out)[1] == index_and_shapes(GOLDEN / "gpt_oss")[1]  # fused experts, sinks, biases
    got, want = (json.loads((p / "config.json").read_text()) for p in (out, GOLDEN / "gpt_oss"))
    for k, v in want.items():
        if k not in ("transformers_version", "dtype", "output_router_logits"):
            assert got.get(k) == v, (k, got.get(k), v)
    back, *_ = imported(out, strategy="hybrid_shard", mesh_shape=(2, 4, 1))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_mxfp4_experts_export_dequantised(tmp_path):
    """The MXFP4 golden exports as the bf16/f32 layout (no quantization_config), its expert
    weights exactly the dequantised values, which re-import bit-exact."""
    ck, params = saved_run(tmp_path, "gpt_oss_mxfp4", perturb=False)
    out = tmp_path / "hf_out"
    export_hf(ck, out)
    names = index_and_shapes(out)[1]
    assert names == index_and_shapes(GOLDEN / "gpt_oss")[1]
    assert "quantization_config" not in json.loads((out / "config.json").read_text())
    src = SafetensorsFile(GOLDEN / "gpt_oss_mxfp4" / "model.safetensors")
    blocks, scales = (src.read(f"model.layers.3.mlp.experts.down_proj_{s}") for s in ("blocks", "scales"))
    fp4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, 0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)
    codes = np.stack([blocks & 15, blocks >> 4], axis=-1).reshape(4, 96, 32)  # (E, out, in)
    want = (fp4[codes] * 2.0 ** (scales.astype(np.float32) - 127)).transpose(0, 2, 1)
    assert np.array_equal(SafetensorsFile(out / "model.safetensors").read("model.layers.3.mlp.experts.down_proj"), want)
    back, *_ = imported(out)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def test_lora_by_peft_names_reaches_attention_and_the_experts_only_as_target_parameters():
    cfg = hf.HFCheckpoint(GOLDEN / "gpt_oss").config
    spec = lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets("q_proj v_proj o_proj"))
    assert spec.targets == ("wq", "wv", "wo") and lora_problems.target_problem(cfg, spec) is None
    adapters = jax.tree_util.tree_leaves_with_path(from_nnx(lambda r: Decoder(cfg, rngs=r, lora=spec)).abstract_params)
    paths = {jax.tree_util.keystr(p) for p, _ in adapters if lora_lib.is_adapter(p)}
    assert paths and all("attn" in p for p in paths)
    assert {p.split("['lora']['")[1].split("'")[0] for p in paths} == {"wq", "wv", "wo"}
    everything = lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets("all-linear"))
    assert lora_lib.adapted(cfg, everything) == (("wq", "wk", "wv", "wo"), ())  # PEFT's all-linear: no expert
    # the experts as PEFT's target_parameters name them (peft 0.21 on GptOss: no target_modules rewrite)
    experts = lora_lib.LoraSpec(4, 8.0, ("wq",), experts=lora_lib.resolve_experts("mlp.experts.gate_up_proj"))
    assert lora_problems.target_problem(cfg, experts) is None
    assert lora_lib.adapted(cfg, experts) == (("wq",), ("experts_gate_up",))
    mlp = lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets("gate_proj up_proj"))  # no nn.Linear of that name
    assert lora_problems.target_problem(cfg, mlp)[1].startswith("gate_proj up_proj names nothing")
    dropped = lora_problems.expert_dropout(cfg, dataclasses.replace(experts, dropout=0.1))
    assert dropped is not None and "no dropout" in dropped


def _edit(dst, src="gpt_oss", drop=(), **changes):
    shutil.copytree(GOLDEN / src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    for k in drop:
        raw.pop(k)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


BAD = [  # (config.json changes, keys dropped, words of the one line)
    ({"layer_types": ["sliding_attention", "chunked_attention"] * 2}, (), ["layer_types", "chunked_attention"]),
    ({"layer_types": ["full_attention"] * 4}, (), ["sliding_window=8", "no layer_types entry is sliding"]),
    ({"sliding_window": None}, (), ["layer_types", "sliding layers need a sliding_window"]),
    (
        {"layer_types": ["sliding_attention", "sliding_attention", "full_attention", "full_attention"]},
        (),
        ["layer_types"],
    ),
    ({"layer_types": ["sliding_attention", "full_attention"]}, (), ["layer_types", "expected 4"]),
    ({"attention_bias": False}, (), ["attention_bias=False"]),
    ({"swiglu_limit": -1}, (), ["swiglu_limit=-1"]),
    ({"num_experts_per_tok": 5}, (), ["num_experts_per_tok=5", "num_local_experts=4"]),
    ({"quantization_config": {"quant_method": "bitsandbytes"}}, (), ["quantization_config"]),
    ({}, ("intermediate_size",), ["intermediate_size", "missing"]),
    ({}, ("num_local_experts",), ["num_experts"]),
    ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4}}, (), ["rope_parameters", "needs factor"]),
]


@pytest.mark.parametrize("changes, drop, words", BAD)
def test_bad_config_json_is_refused_naming_the_key(tmp_path, changes, drop, words):
    with pytest.raises(ConfigError) as e:
        hf.HFCheckpoint(_edit(tmp_path / "m", drop=drop, **changes))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_input_is_one_line_exit_2(tmp_path, capsys):
    """The train command: one line naming the key, exit 2, nothing written."""
    run = tmp_path / "run"
    for i, (changes, drop, words) in enumerate(BAD[:3]):
        yml = tmp_path / f"c{i}.yaml"
        path = _edit(tmp_path / f"m{i}", drop=drop, **changes)
        yml.write_text(f"init_from: hf:{path}\nrun_dir: {run}\ndata: {{seq_len: 32, path: {tmp_path / 'd'}}}\n")
        rc, _, err = call("train", "--config", yml, capsys=capsys)
        one_line(rc, err, *words)
    assert not run.exists()


def test_bad_mxfp4_tensors_are_refused(tmp_path):
    dst = tmp_path / "m"
    shutil.copytree(GOLDEN / "gpt_oss_mxfp4", dst)
    f = SafetensorsFile(GOLDEN / "gpt_oss_mxfp4" / "model.safetensors")
    gone = "model.layers.2.mlp.experts.gate_up_proj_scales"
    tensors = {n: f.read(n) for n in f.tensors if n != gone}
    (dst / "model.safetensors").unlink()
    write_safetensors(dst / "model.safetensors", [(n, t.shape, t.dtype) for n, t in tensors.items()], tensors.get)
    with pytest.raises(CheckpointError, match=f"tensor {gone} is missing"):
        hf.HFCheckpoint(dst)
    plain = _edit(tmp_path / "p", quantization_config={"quant_method": "mxfp4"})  # says MXFP4, holds f32
    with pytest.raises(CheckpointError, match="layers.0.mlp.experts.down_proj_blocks is missing"):
        hf.HFCheckpoint(plain)


def test_sinks_take_the_rest_of_the_softmax_and_refuse_other_kernels():
    """With a huge sink logit a head's attention output goes to 0; with a very negative one it is
    plain attention. Flash kernels and context parallelism are refused by name."""
    cfg = DecoderConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=32, family="gpt_oss")
    assert families.block_parts(cfg).attention is SinkAttention
    with nnx.use_eager_sharding(False):
        attn = nnx.jit(lambda: SinkAttention(cfg, nnx.Rngs(0)))()  # one compile, not one per op
    x = jax.random.normal(jax.random.key(0), (1, 6, 32))
    attn.sinks[...] = jnp.asarray([1e4, -1e4])

    @nnx.jit
    def attended(attn, x):  # one program: the projections, sink attention and plain attention
        q, k, v = attn.project(x)
        return attn.attend(q, k, v), jax.nn.dot_product_attention(q, k, v, is_causal=True), (q, k, v)

    o, plain, qkv = attended(attn, x)
    assert float(np.abs(np.asarray(o)[:, :, 0]).max()) < 1e-6
    assert float(np.abs(np.asarray(o)[:, :, 1] - np.asarray(plain)[:, :, 1]).max()) < 1e-5
    attn.impl = "cudnn"
    with pytest.raises(ConfigError, match="model.attention"):
        attn.attend(*qkv)


def test_a_bf16_checkpoint_imports_as_its_values(tmp_path):
    """gpt-oss as published in bfloat16 (no MXFP4): every param is the checkpoint's value."""
    dst = tmp_path / "bf16"
    shutil.copytree(GOLDEN / "gpt_oss", dst)
    f = SafetensorsFile(GOLDEN / "gpt_oss" / "model.safetensors")
    tensors = {n: f.read(n, dtype=ml_dtypes.bfloat16) for n in f.tensors}
    (dst / "model.safetensors").unlink()
    write_safetensors(dst / "model.safetensors", [(n, t.shape, t.dtype) for n, t in tensors.items()], tensors.get)
    ckpt = hf.HFCheckpoint(dst)
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    got = hf.load_params(ckpt, m.abstract_params)
    want = hf.load_params(hf.HFCheckpoint(GOLDEN / "gpt_oss"), m.abstract_params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        assert np.array_equal(np.asarray(a), np.asarray(b).astype(ml_dtypes.bfloat16).astype(np.float32))


@pytest.mark.slow
def test_train_steps_match_one_device_under_fsdp_and_expert_parallelism():
    """3 SGD steps (f32, aux loss on) of the tiny gpt-oss: the loss falls, and full_shard over 8
    devices and experts over the tensor axis give one device's losses (gradients through the
    sinks, biases and clamps)."""
    cfg = hf.HFCheckpoint(GOLDEN / "gpt_oss").config

    def losses(mesh, rules=None):
        m = from_nnx(lambda r: Decoder(cfg, rngs=r))
        built = build(
            m,
            optax.sgd(0.5),
            mesh,
            "full_shard",
            loss_fn=make_loss_fn(m, cfg),
            has_aux=True,
            rules=rules,
            min_shard_size=0,
        )
        state = built.init_state(jax.random.key(0))
        batch = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab_size)
        out = []
        for _ in range(3):
            state, metrics = built.train_step(state, batch)
            out.append(float(metrics["loss"]))
        return np.asarray(out)

    one = losses(make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    assert one[-1] < one[0]
    for shape, rules in (((1, 8, 1), None), ((1, 4, 2), {**DEFAULT_RULES, "expert": "tensor"})):
        got = losses(make_mesh(*shape), rules)
        assert np.abs(got / one - 1).max() <= 1e-5, (shape, got, one)


# config.json of openai/gpt-oss-20b: its architecture keys
GPT_OSS_20B = {
    "model_type": "gpt_oss",
    "architectures": ["GptOssForCausalLM"],
    "num_hidden_layers": 24,
    "num_local_experts": 32,
    "num_experts_per_tok": 4,
    "vocab_size": 201088,
    "hidden_size": 2880,
    "intermediate_size": 2880,
    "head_dim": 64,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "sliding_window": 128,
    "max_position_embeddings": 131072,
    "rms_norm_eps": 1e-05,
    "rope_theta": 150000,
    "rope_scaling": {
        "rope_type": "yarn",
        "factor": 32.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 4096,
    },
    "swiglu_limit": 7.0,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
}


def test_shipped_config_is_gpt_oss_20b():
    """configs/gpt_oss_20b.yaml is the published architecture; its counts are the model card's
    20.91B total and 3.61B active (the active count leaves the embedding table out)."""
    cfg = load_config(GOLDEN.parents[1].parent / "configs" / "gpt_oss_20b.yaml")
    assert cfg.model == model_config_from_hf(GPT_OSS_20B, base=cfg.model)
    assert count_params(cfg.model) == 20_914_757_184
    active = count_params(cfg.model, active=True) - 201088 * 2880
    assert round(count_params(cfg.model) / 1e9, 2) == 20.91 and round(active / 1e9, 2) == 3.61
    big = model_config_from_hf({**GPT_OSS_20B, "num_hidden_layers": 36, "num_local_experts": 128, "layer_types": None})
    assert big.global_every == 2 and big.sliding_window == 128  # no layer_types: transformers' alternation
    total, active = count_params(big), count_params(big, active=True) - 201088 * 2880
    assert round(total / 1e9, 2) == 116.83 and round(active / 1e9, 2) == 5.13  # gpt-oss-120b's
    big_yaml = load_config(GOLDEN.parents[1].parent / "configs" / "gpt_oss_120b.yaml")
    assert big_yaml.model == model_config_from_hf(
        {
            **GPT_OSS_20B,
            "num_hidden_layers": 36,
            "num_local_experts": 128,
            "layer_types": ["sliding_attention", "full_attention"] * 18,
        },
        base=big_yaml.model,
    )  # configs/gpt_oss_120b.yaml: openai/gpt-oss-120b's config.json differs from 20b's in these keys


@pytest.mark.slow
def test_expert_adapters_in_capacity_mode_equal_dropless_and_the_merged_experts():
    """gpt-oss's expert adapters (B drawn, not zero) through capacity dispatch with room for every
    pair equal the dropless path's logits, and both equal a plain decoder on the merged experts
    (W_gate_up + scale A B per expert, the interleaved columns as they are)."""
    cfg = hf.HFCheckpoint(GOLDEN / "gpt_oss").config
    spec = lora_lib.LoraSpec(4, 8.0, ("wq",), experts=tuple(lora_lib.EXPERT_ADAPTERS), init_weights=False)
    tokens = np.arange(2 * 16).reshape(2, 16) % cfg.vocab_size

    def logits(c, lora=spec, params=None):
        m = from_nnx(lambda r: Decoder(c, rngs=r, lora=lora))
        p = jax.jit(m.init)(jax.random.key(3)) if params is None else params  # jitted: one compile, not one per op
        return np.asarray(jax.jit(m.apply)(p, tokens)), p

    dropless, params = logits(cfg)
    capacity, _ = logits(dataclasses.replace(cfg, capacity_factor=float(cfg.n_experts)), params=params)
    np.testing.assert_allclose(capacity, dropless, atol=2e-5)
    base, adapters = lora_lib.split(jax.tree.map(np.asarray, params))
    merged = peft.merge(base, adapters, cfg, spec)
    moe = merged["segments"][0]["layers"][0]["moe"]
    assert not np.array_equal(moe["w_gate_up"], base["segments"][0]["layers"][0]["moe"]["w_gate_up"])
    plain, _ = logits(cfg, None, merged)
    np.testing.assert_allclose(dropless, plain, atol=1e-4)
