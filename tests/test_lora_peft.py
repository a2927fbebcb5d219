"""PEFT LoRA adapters in and out: adapters written by `peft` itself (tests/golden/peft/,
make_peft_goldens.py) load as the decoder's adapters and reproduce peft's logits (and the
merged model's) within 1e-4 for every family; the written adapter reads back bit for bit
with PEFT's key names; a PEFT adapter for another rank or base is refused in one line."""

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.hf import peft, peft_experts
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models import lora_problems
from fsdp_jax.app.models.decoder import Decoder
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile
from fsdp_jax.errors import CheckpointError
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from fsdp_jax.train.step import sharding_context

GOLDEN = Path(__file__).parent / "golden"
ADAPTERS = ("llama3", "llama32_tied", "mistral_swa", "qwen2", "qwen3", "gemma3_text", "llama3_rslora")
# the experts by target_parameters; Qwen2-MoE's dense layers and shared expert by target_modules
# (qwen2_moe_shared: those only, no target_parameters; gpt_oss: its attention, biases and all)
# gpt_oss: attention only; gpt_oss_experts: + its experts by target_parameters (biased, clamped, gate / up interleaved)
# qwen3_moe_rewritten: the seven names, which peft 0.21 rewrites to the experts (gate_up_proj at rank 2r by rank_pattern)
MOE_ADAPTERS = (
    "mixtral",
    "qwen3_moe",
    "qwen3_moe_rewritten",
    "qwen2_moe",
    "qwen2_moe_shared",
    "gpt_oss",
    "gpt_oss_experts",
)
# deepseek_v3: latent attention's five projections (q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj),
# the dense layer's MLP and the shared experts (target_parameters mlp.gate_proj.weight ...,
# mlp.shared_experts.gate_proj.weight ...: peft 0.21 maps those target_modules names to the experts)
# deepseek_v3_rewritten: the five and target_modules gate_proj up_proj down_proj, which peft 0.21 rewrites
# to the routed experts (gate_up_proj at rank 2r by rank_pattern / alpha_pattern, down_proj at r)
# deepseek_v3_all_linear: peft's all-linear there, the same plus the router (target_parameters gate.weight)
MLA_ADAPTERS = ("deepseek_v3", "deepseek_v3_rewritten", "deepseek_v3_all_linear")


def spec_of(raw: dict, cfg) -> lora_lib.LoraSpec:
    by_param = peft.parameter_targets(cfg)
    params = [peft.full_parameter_name(p, by_param) for p in raw.get("target_parameters") or []]
    targets = lora_lib.resolve_targets(" ".join(raw["target_modules"] + [by_param[p] for p in params if p in by_param]))
    experts = peft_experts.parts_of([p for p in params if p not in by_param])
    gate_up = peft_experts.pattern_rank(raw)
    return lora_lib.LoraSpec(
        raw["r"], float(raw["lora_alpha"]), targets, bool(raw.get("use_rslora")), experts=experts, gate_up_rank=gate_up
    )


def golden(name):
    raw = json.loads((GOLDEN / "peft" / name / "adapter_config.json").read_text())
    ckpt = hf.HFCheckpoint(GOLDEN / "hf" / Path(raw["base_model_name_or_path"]).name)
    f = SafetensorsFile(GOLDEN / "peft" / f"{name}_logits.safetensors")
    return ckpt, spec_of(raw, ckpt.config), {k: f.read(k) for k in ("tokens", "logits", "merged_logits")}


def logits(model, params, plan, tokens):
    batch = np.tile(tokens, (4, 1))  # 8 rows: divisible by the batch sharding
    with sharding_context(plan):
        return np.asarray(jax.jit(model.apply)(params, batch))[: len(tokens)]


@pytest.mark.parametrize("name", ADAPTERS + MOE_ADAPTERS + MLA_ADAPTERS)
@pytest.mark.fast_cases("llama3", "gemma3_text", "mixtral")
def test_peft_adapter_reproduces_peft_logits_and_merged_logits(name, tmp_path):
    ckpt, spec, want = golden(name)
    cfg = ckpt.config
    model = trainer_model(cfg, "none", spec)
    built = build(model, optax.sgd(0.1), make_mesh(1, 8, 1), "full_shard", min_shard_size=0)
    base_abs, ad_abs = lora_lib.split(built.abstract_state.params)
    base = hf.load_params(ckpt, base_abs)
    adapters = peft.read_peft(GOLDEN / "peft" / name, cfg, spec)
    placed = jax.tree.map(lambda x, s: jax.device_put(x, s.sharding), adapters, ad_abs)
    got = logits(model, lora_lib.join(base, placed), built.plan, want["tokens"])
    assert float(np.abs(got - want["logits"]).max()) < 1e-4

    # merged: a plain decoder on W + scale * A B matches peft's merge_and_unload logits
    host_base = jax.tree.map(np.asarray, base)
    merged = peft.merge(host_base, adapters, cfg, spec)
    plain = from_nnx(lambda r: Decoder(cfg, rngs=r))
    got_merged = logits(plain, merged, built.plan, want["tokens"])
    assert float(np.abs(got_merged - want["merged_logits"]).max()) < 1e-4
    untouched = [p for p, _ in peft._flat(host_base) if peft.adapter_of(p, cfg, spec) is None]
    for p in untouched:  # tensors LoRA did not touch are the base's own arrays
        keys = [int(k) if k.isdigit() else k for k in p.split("/")]
        assert peft._at(merged, tuple(keys[:-1]))[keys[-1]] is peft._at(host_base, tuple(keys[:-1]))[keys[-1]], p
    assert len(untouched) < len(list(peft._flat(host_base)))
    assert merged["embed"] is host_base["embed"]

    # written back: PEFT's names and orientation, bit for bit
    out = tmp_path / "adapter"
    info = peft.write_peft(out, adapters, cfg, spec)
    theirs = SafetensorsFile(GOLDEN / "peft" / name / "adapter_model.safetensors")
    ours = SafetensorsFile(out / "adapter_model.safetensors")
    assert set(ours.tensors) == set(theirs.tensors) and info["tensors"] == len(theirs.tensors)
    for k in theirs.tensors:
        np.testing.assert_array_equal(ours.read(k), theirs.read(k))
    raw, written = (json.loads((d / "adapter_config.json").read_text()) for d in (GOLDEN / "peft" / name, out))
    for key in ("rank_pattern", "alpha_pattern"):  # PEFT's own patterns (deepseek_v3_rewritten: gate_up_proj's)
        assert (written.get(key) or {}) == (raw.get(key) or {}), key
    back = peft.read_peft(out, cfg, spec)
    assert all(np.array_equal(a, b) for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(adapters)))


def test_unscanned_layers_read_the_same_adapter():
    ckpt, spec, want = golden("llama3_rslora")
    cfg = hf.HFCheckpoint(ckpt.path, base=hf.DecoderConfig(scan_layers=False)).config
    scanned = peft.read_peft(GOLDEN / "peft" / "llama3_rslora", ckpt.config, spec)
    flat = peft.read_peft(GOLDEN / "peft" / "llama3_rslora", cfg, spec)
    a = scanned["blocks"]["attn"]["lora"]["wq"]["lora_a"]
    np.testing.assert_array_equal(flat["blocks"][1]["attn"]["lora"]["wq"]["lora_a"], a[1])
    assert peft.to_peft(flat, cfg, spec).keys() == peft.to_peft(scanned, ckpt.config, spec).keys()


def _copy(tmp_path, edit=None, drop=None):
    d = tmp_path / "a"
    shutil.copytree(GOLDEN / "peft" / "llama3", d)
    if edit:
        raw = json.loads((d / "adapter_config.json").read_text())
        raw.update(edit)
        (d / "adapter_config.json").write_text(json.dumps(raw))
    if drop:
        (d / drop).unlink()
    return d


BAD_ADAPTERS = [
    ({"r": 8}, None, "lora", "rank=8"),
    ({"lora_alpha": 4}, None, "alpha=4", "lora.alpha"),
    ({"target_modules": ["q_proj"]}, None, "targets=q_proj", "lora.targets"),
    ({"use_dora": True}, None, "DoRA", "not supported"),
    (None, "adapter_config.json", "no adapter_config.json", "not a PEFT adapter"),
    (None, "adapter_model.safetensors", "no adapter_model.safetensors", "peft:"),
]


@pytest.mark.parametrize("edit,drop,word1,word2", BAD_ADAPTERS)
def test_a_peft_adapter_for_another_rank_or_base_is_refused_in_one_line(tmp_path, edit, drop, word1, word2):
    ckpt, spec, _ = golden("llama3")
    d = _copy(tmp_path, edit, drop)
    with pytest.raises(CheckpointError) as e:
        peft.read_peft(d, ckpt.config, spec)
    msg = str(e.value)
    assert "\n" not in msg and word1 in msg and word2 in msg, msg


def test_an_adapter_for_another_base_is_refused_in_one_line():
    ckpt, spec, _ = golden("llama3")
    d = GOLDEN / "peft" / "llama3"
    deeper = dataclasses.replace(ckpt.config, n_layers=ckpt.config.n_layers + 1)
    with pytest.raises(CheckpointError, match=r"no tensor base_model.model.model.layers.2.self_attn.q_proj.lora_A"):
        peft.read_peft(d, deeper, spec)
    wider = dataclasses.replace(ckpt.config, ffn_dim=2 * ckpt.config.ffn_dim)
    with pytest.raises(CheckpointError, match=r"gate_proj.lora_B.weight has shape \(128, 4\).*another base or rank"):
        peft.read_peft(d, wider, spec)


def _rewritten(tmp_path, edit):
    d = tmp_path / "rw"
    shutil.copytree(GOLDEN / "peft" / "deepseek_v3_rewritten", d)
    raw = json.loads((d / "adapter_config.json").read_text())
    (d / "adapter_config.json").write_text(json.dumps({**raw, **edit}))
    return d


def test_peft_rewritten_deepseek_adapter_needs_its_gate_up_rank_and_refuses_other_patterns(tmp_path):
    """peft's own rewrite of target_modules gate_proj / up_proj / down_proj on DeepSeek-V3 reads with
    lora.gate_up_rank = its rank_pattern; a run without it, an alpha_pattern that does not scale with the
    rank, a pattern on another tensor and a router adapter the run does not name are each refused in one line."""
    ckpt, spec, _ = golden("deepseek_v3_rewritten")
    assert spec.gate_up_rank == 8 and spec.expert("experts_gate_up").scale == spec.scale == 2.0
    cfg = ckpt.config
    cases = [
        (GOLDEN / "peft" / "deepseek_v3_rewritten", dataclasses.replace(spec, gate_up_rank=0), "gate_up_rank=8"),
        (_rewritten(tmp_path / "1", {"alpha_pattern": {}}), spec, "alpha_pattern"),
        (_rewritten(tmp_path / "2", {"rank_pattern": {".*\\.q_a_proj": 8}}), spec, "q_a_proj"),
        (
            _rewritten(tmp_path / "3", {"target_parameters": ["down_proj", "gate_up_proj", "gate.weight"]}),
            spec,
            "targets=",  # all-linear's router adapter: the run's lora.targets must name gate
        ),
    ]
    for d, run_spec, word in cases:
        with pytest.raises(CheckpointError) as e:
            peft.read_peft(d, cfg, run_spec)
        msg = str(e.value)
        assert "\n" not in msg and word in msg, msg
    no_experts = dataclasses.replace(spec, experts=())
    assert lora_problems.target_problem(cfg, no_experts)[0] == "lora.gate_up_rank"
    assert lora_problems.target_problem(cfg, spec) is None
