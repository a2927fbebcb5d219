"""DeepSeek-V3 (families/deepseek_v3.py: models/latent_attention.py, models/moe_grouped.py)
against transformers' own DeepseekV3ForCausalLM (tests/golden/make_hf_deepseek_goldens.py):
logits under every strategy and expert parallelism, the experts each token's grouped router
chooses, export round trips, bad config.json keys.

Golden: 3 layers (the first dense), latent attention with q and kv compression and the
decoupled RoPE key, YaRN with mscale, 8 experts in 4 groups, a shared expert, 2 x 40 tokens."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_hf import GOLDEN, MESHES, index_and_shapes, saved_run

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.hf import peft
from fsdp_jax.app.hf.config_in import model_config_from_hf
from fsdp_jax.app.hf.export import export_hf
from fsdp_jax.app.models import Decoder, DecoderConfig, count_params, lora_problems
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.moe_grouped import GroupedMoE
from fsdp_jax.app.trainer.build import make_loss_fn
from fsdp_jax.app.trainer.optim import decay_mask
from fsdp_jax.checkpoint import tree_paths
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile
from fsdp_jax.errors import CheckpointError, ConfigError
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rule_table import DEFAULT_RULES
from fsdp_jax.train.build import build
from fsdp_jax.train.step import sharding_context
from helpers import call, one_line

NAME = "deepseek_v3"
EP = {**DEFAULT_RULES, "expert": "tensor"}


def golden():
    f = SafetensorsFile(GOLDEN / f"{NAME}_logits.safetensors")
    return {k: f.read(k) for k in f.tensors}


def imported(path=GOLDEN / NAME, strategy="full_shard", mesh_shape=(1, 8, 1), scan=True, rules=None):
    ckpt = hf.HFCheckpoint(path, base=DecoderConfig(scan_layers=scan))
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    built = build(m, optax.sgd(0.1), make_mesh(*mesh_shape), strategy, min_shard_size=0, rules=rules)
    return hf.load_params(ckpt, built.abstract_state.params), m, built.plan, ckpt.config


def check(**kw):
    g = golden()
    params, m, plan, cfg = imported(**kw)
    with sharding_context(plan):
        logits = jax.jit(m.apply)(params, jnp.asarray(np.tile(g["tokens"], (4, 1))))
    err = float(np.abs(np.asarray(logits)[:2] - g["logits"]).max())
    assert err < 1e-4, (kw, err)
    return params, cfg


@pytest.fixture(scope="module")
def full_shard():
    return check()


def test_import_matches_transformers_logits(full_shard):
    params, cfg = full_shard
    assert cfg.family == NAME and cfg.kv_lora_rank == 32 and cfg.q_lora_rank == 48 and cfg.head_dim == 8
    assert cfg.mlp_only_layers == (0,) and cfg.n_group == 4 and cfg.routed_scaling_factor == 2.5
    attn = params["segments"][1]["layers"][0]["attn"]  # the sparse layers' stack
    assert attn["wkv_b"].shape == (2, 32, 4, 40) and attn["wq_b"].shape == (2, 48, 4, 24)
    spec = jax.sharding.PartitionSpec
    assert attn["wkv_b"].sharding.spec == spec(None, "fsdp", None, None)  # kv_lora -> fsdp, not replicated
    assert attn["wkv_a"].sharding.spec == spec(None, "fsdp", None)  # its embed dim
    assert count_params(cfg) == sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    per_expert = 3 * 64 * 32
    assert count_params(cfg) - count_params(cfg, active=True) == 2 * (8 - 2) * per_expert


def _numpy_choice(logits, bias, k=2, groups=4, top_groups=2):
    """transformers' DeepseekV3TopkRouter, in numpy: the chosen experts per token, sorted."""
    choice = 1 / (1 + np.exp(-logits.astype(np.float64))) + bias
    n, e = choice.shape
    grp = np.sort(choice.reshape(n, groups, e // groups), -1)[..., -2:].sum(-1)
    keep = np.argsort(-grp, -1)[:, :top_groups]
    allowed = np.zeros((n, e), bool)
    for j in range(top_groups):
        for m in range(e // groups):
            allowed[np.arange(n), keep[:, j] * (e // groups) + m] = True
    return np.sort(np.argsort(-np.where(allowed, choice, -np.inf), -1)[:, :k], -1)


@pytest.mark.slow
def test_router_chooses_the_experts_transformers_chooses():
    ckpt = hf.HFCheckpoint(GOLDEN / NAME, base=DecoderConfig(scan_layers=False))
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    params = hf.load_params(ckpt, m.abstract_params)
    g, plain = golden(), GroupedMoE.route_tokens

    def routed(p, tokens):
        """Each sparse layer's (router logits, route_tokens' outputs): one jitted forward (no mesh),
        not an eager one compiling each op of the unscanned model (~200 compiles)."""
        seen = []

        def record(self, logits):
            out = plain(self, logits)
            seen.append((logits, out))
            return out

        GroupedMoE.route_tokens = record
        try:
            m.apply(p, tokens)
        finally:
            GroupedMoE.route_tokens = plain
        return seen

    seen = jax.device_get(jax.jit(routed)(params, jnp.asarray(g["tokens"])))
    assert len(seen) == 2
    f = SafetensorsFile(GOLDEN / NAME / "model.safetensors")
    for layer, (logits, (probs, w, idx)) in zip((1, 2), seen):
        assert np.allclose(np.asarray(probs).sum(-1), 1.0, atol=1e-6)  # the statistics' probabilities
        # the chosen sigmoid scores renormalised, times routed_scaling_factor
        np.testing.assert_allclose(np.asarray(w).sum(-1), 2.5, rtol=1e-6)
        theirs = g[f"router_logits_{layer}"]
        assert float(np.abs(logits - theirs).max()) < 1e-4
        bias = f.read(f"model.layers.{layer}.mlp.gate.e_score_correction_bias")
        assert np.array_equal(np.sort(idx, -1), _numpy_choice(theirs, bias)), layer


@pytest.mark.slow
def test_unscanned_fsdp_x_tensor_and_expert_parallel_match_transformers():
    check(scan=False, mesh_shape=(1, 4, 2))
    params, _ = check(mesh_shape=(1, 4, 2), rules=EP)
    leaf = params["segments"][1]["layers"][0]["moe"]["w_gate"]
    assert leaf.sharding.spec[1] == "tensor" and leaf.addressable_shards[0].data.shape[1] == 4


@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in MESHES if s != "full_shard"])
def test_import_matches_transformers_every_strategy(strategy):
    check(strategy=strategy, mesh_shape=MESHES[strategy])


@pytest.mark.slow
def test_export_round_trips_bit_exact_and_writes_the_published_layout(tmp_path):
    ck, params = saved_run(tmp_path, NAME)
    out = tmp_path / "hf_out"
    export_hf(ck, out)
    assert index_and_shapes(out)[1] == index_and_shapes(GOLDEN / NAME)[1]
    got, want = (json.loads((p / "config.json").read_text()) for p in (out, GOLDEN / NAME))
    for k, v in want.items():
        if k not in ("transformers_version", "dtype", "output_router_logits", "pad_token_id"):
            assert got.get(k) == v, (k, got.get(k), v)
    back, *_ = imported(out, strategy="hybrid_shard", mesh_shape=(2, 4, 1))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _edit(dst, drop=(), **changes):
    shutil.copytree(GOLDEN / NAME, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    for k in drop:
        raw.pop(k)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


BAD = [  # (config.json changes, keys dropped, words of the one line)
    ({"topk_group": 5}, (), ["topk_group=5", "larger than n_group=4"]),
    ({"kv_lora_rank": 0}, (), ["kv_lora_rank=0"]),
    ({"n_group": 3}, (), ["n_group=3", "must divide n_routed_experts=8"]),
    ({"num_nextn_predict_layers": -1}, (), ["num_nextn_predict_layers=-1", "integer >= 0"]),
    ({"rope_interleave": False}, (), ["rope_interleave=False"]),
    ({"head_dim": 16}, (), ["head_dim=16", "qk_rope_head_dim=8"]),
    ({"first_k_dense_replace": 3}, (), ["first_k_dense_replace=3", "no sparse layer"]),
    ({"scoring_func": "softmax"}, (), ["scoring_func"]),
    ({"attention_bias": True}, (), ["attention_bias=True"]),
    ({"quantization_config": {"quant_method": "fp8"}}, (), ["quantization_config"]),
    ({}, ("moe_intermediate_size",), ["moe_intermediate_size"]),
    ({"num_experts_per_tok": 9}, (), ["num_experts_per_tok=9"]),
]


@pytest.mark.parametrize("changes, drop, words", BAD)
def test_bad_config_json_is_refused_naming_the_key(tmp_path, changes, drop, words):
    with pytest.raises(ConfigError) as e:
        hf.HFCheckpoint(_edit(tmp_path / "m", drop=drop, **changes))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_input_is_one_line_exit_2_and_lora_takes_latent_attentions_peft_names(tmp_path, capsys):
    run = tmp_path / "run"
    for i, (changes, drop, words) in enumerate(BAD[:2]):
        yml = tmp_path / f"c{i}.yaml"
        path = _edit(tmp_path / f"m{i}", drop=drop, **changes)
        yml.write_text(f"init_from: hf:{path}\nrun_dir: {run}\ndata: {{seq_len: 32, path: {tmp_path / 'd'}}}\n")
        rc, _, err = call("train", "--config", yml, capsys=capsys)
        one_line(rc, err, *words)
    assert not run.exists()
    cfg = hf.HFCheckpoint(GOLDEN / NAME).config
    problem = lora_problems.target_problem(cfg, lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets("q_proj k_proj")))
    assert problem[0] == "lora.targets" and problem[1].startswith("q_proj k_proj names nothing")
    assert "q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj" in problem[1]  # what there is, PEFT's names
    mla = lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets("q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj"))
    assert lora_problems.target_problem(cfg, mla) is None
    # all-linear: latent attention, the dense layer's MLP and the shared experts (every nn.Linear but the head)
    every = lora_lib.LoraSpec(4, 8.0, lora_lib.TARGETS)
    assert lora_lib.adapted(cfg, every) == (tuple(t for t in lora_lib.TARGETS if t in mla.targets + MLP), ())
    assert lora_problems.target_problem(cfg, lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets("gate_proj"))) is None
    # the routed experts only as lora.target_parameters names them (auto: none)
    named = dataclasses.replace(
        every, experts=lora_lib.resolve_experts("mlp.experts.gate_up_proj mlp.experts.down_proj")
    )
    assert lora_problems.target_problem(cfg, named) is None and lora_lib.adapted(cfg, named)[1] == named.experts
    # the adapters' params: PEFT's own tensors of the golden adapter (tests/golden/peft/deepseek_v3)
    peft_file = SafetensorsFile(GOLDEN.parent / "peft" / NAME / "adapter_model.safetensors")
    assert lora_lib.adapter_param_count(cfg, named) == sum(
        int(np.prod(peft_file.read(k).shape)) for k in peft_file.tensors
    )


MLP = ("w_gate", "w_up", "w_down")


def test_lora_on_the_mlps_is_written_as_peft_target_parameters_and_refuses_dropout():
    """peft 0.21 on transformers 5.25 maps DeepSeek-V3's target_modules gate/up/down_proj to the routed
    experts: the dense MLPs and shared experts go out (and come in) as target_parameters, as the golden's."""
    cfg = hf.HFCheckpoint(GOLDEN / NAME).config
    every = lora_lib.LoraSpec(4, 8.0, lora_lib.TARGETS, experts=tuple(lora_lib.EXPERT_ADAPTERS))
    theirs = json.loads((GOLDEN.parent / "peft" / NAME / "adapter_config.json").read_text())
    ours = peft.adapter_config(every, None, cfg)
    assert ours["target_modules"] == theirs["target_modules"]  # the five latent attention projections
    assert sorted(ours["target_parameters"]) == sorted(theirs["target_parameters"])  # + the routed experts
    assert "target_parameters" not in peft.adapter_config(
        dataclasses.replace(every, targets=("wq_a",), experts=()), None, cfg
    )
    peft.check_matches(theirs, every, "peft:x", cfg)  # the golden's config means what the run's does
    as_modules = {**theirs, "target_modules": theirs["target_modules"] + ["gate_proj", "up_proj", "down_proj"]}
    for raw in ({**as_modules, "target_parameters": []}, {**theirs, "target_modules": "all-linear"}):
        with pytest.raises(CheckpointError, match=r"^peft:x: target_modules down_proj gate_proj up_proj .*experts"):
            peft.check_matches(raw, every, "peft:x", cfg)  # PEFT's meaning there: the routed experts
    line = lora_problems.expert_dropout(cfg, dataclasses.replace(every, dropout=0.1))
    assert "deepseek_v3's MLPs take no dropout" in line and "\n" not in line
    assert (
        lora_problems.expert_dropout(cfg, dataclasses.replace(every, targets=("wq_a",), experts=(), dropout=0.1))
        is None
    )


@pytest.mark.slow
def test_train_steps_match_one_device_and_leave_the_score_bias():
    """3 SGD steps: the loss falls, full_shard over 8 devices and experts over tensor give one
    device's losses, and the score-correction bias takes no gradient step."""
    cfg = hf.HFCheckpoint(GOLDEN / NAME).config

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
        bias0 = np.asarray(state.params["segments"][1]["layers"][0]["moe"]["score_bias"])
        batch = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab_size)
        out = []
        for _ in range(3):
            state, metrics = built.train_step(state, batch)
            out.append(float(metrics["loss"]))
        assert np.array_equal(np.asarray(state.params["segments"][1]["layers"][0]["moe"]["score_bias"]), bias0)
        return np.asarray(out)

    one = losses(make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    assert one[-1] < one[0]
    for shape, rules in (((1, 8, 1), None), ((1, 4, 2), EP)):
        got = losses(make_mesh(*shape), rules)
        assert np.abs(got / one - 1).max() <= 1e-5, (shape, got, one)


# config.json of deepseek-ai/DeepSeek-V3: its architecture keys, without the MTP layer
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3",
    "architectures": ["DeepseekV3ForCausalLM"],
    "vocab_size": 129280,
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "routed_scaling_factor": 2.5,
    "kv_lora_rank": 512,
    "q_lora_rank": 1536,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 8,
    "topk_group": 4,
    "num_experts_per_tok": 8,
    "first_k_dense_replace": 3,
    "norm_topk_prob": True,
    "scoring_func": "sigmoid",
    "topk_method": "noaux_tc",
    "max_position_embeddings": 163840,
    "rms_norm_eps": 1e-06,
    "rope_theta": 10000,
    "rope_scaling": {
        "type": "yarn",
        "factor": 40,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
    },
    "tie_word_embeddings": False,
    "num_nextn_predict_layers": 0,
}


def test_shipped_config_is_deepseek_v3():
    """configs/deepseek_v3.yaml is the published architecture: the report's 671B total, 37B active."""
    cfg = load_config(GOLDEN.parents[1].parent / "configs" / "deepseek_v3.yaml")
    assert cfg.model == model_config_from_hf(DEEPSEEK_V3, base=cfg.model)
    assert count_params(cfg.model) == 671_026_419_200
    assert int(count_params(cfg.model, active=True) / 1e9) == 37


def test_weight_decay_leaves_the_score_bias(full_shard):
    """AdamW's decoupled decay would move it without a gradient: the trainer's mask leaves it out."""
    params, _ = full_shard
    mask = tree_paths(decay_mask(params))
    assert mask["segments/1/layers/0/moe/score_bias"] is False and mask["segments/1/layers/0/moe/w_gate"] is True
