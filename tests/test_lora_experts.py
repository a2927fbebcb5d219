"""LoRA on the experts of mixture-of-experts models (PEFT's `target_parameters` on
transformers' fused expert tensors; the PEFT goldens are in tests/test_lora_peft.py):
adapters per expert, sharded with their experts; the factored form in every expert path
(dropless grouped matmuls, capacity, experts over a batch axis by all-to-all) equal to the
merged weights; 8 devices train as one; no gradient of a frozen expert tensor's shape in the
compiled step; counts and refusals."""

import dataclasses

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from test_lora_moe import dropout_reference, merged_logits, moe_cfg, nonzero_b, reference_train, tokens

from fsdp_jax.app.hf import peft
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.decoder import Decoder, count_params, flops_per_token
from fsdp_jax.app.trainer.build import lora_optimizer, make_loss_fn, trainer_model
from fsdp_jax.errors import ConfigError
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rule_table import DEFAULT_RULES
from fsdp_jax.train.build import build
from helpers import max_abs_diff, weight_shaped_results

SPEC = lora_lib.LoraSpec(rank=4, alpha=8.0, targets=lora_lib.WEIGHTS)  # all-linear: attention + experts
SGD = optax.sgd(0.1, momentum=0.9)
KINDS = {
    "dropless": lambda: moe_cfg(),
    "capacity": lambda: moe_cfg(capacity_factor=2.0),  # C = N: none dropped, on one device or eight
    "dense_layer": lambda: moe_cfg(mlp_only_layers=(1,)),  # its MLP keeps no adapters
}


def test_expert_adapters_are_per_expert_and_shard_with_their_experts():
    cfg = moe_cfg(mlp_only_layers=(1,))
    model = trainer_model(cfg, "none", SPEC)
    e, d, f, r = cfg.n_experts, cfg.d_model, cfg.moe_ffn_dim, SPEC.rank
    shapes = {p: x.shape for p, x in _flat(lora_lib.split(model.abstract_params)[1]).items()}
    moe = "segments/0/layers/0/moe"
    gu, dn = f"{moe}/lora/experts_gate_up", f"{moe}/lora/experts_down"
    assert shapes[f"{gu}/lora_a"] == (1, e, d, r) and shapes[f"{gu}/lora_b"] == (1, e, r, 2 * f)
    assert shapes[f"{dn}/lora_a"] == (1, e, f, r) and shapes[f"{dn}/lora_b"] == (1, e, r, d)
    assert not any("/mlp/lora/" in p for p in shapes)  # the dense layer's MLP: none
    assert sum(int(np.prod(s)) for s in shapes.values()) == lora_lib.adapter_param_count(cfg, SPEC)
    # experts split over tensor, embed over fsdp: A's expert and input dims as the expert
    # tensor's, B's expert and output dims as its, the rank dim replicated
    rules = {**DEFAULT_RULES, "expert": "tensor"}
    built = build(model, lora_optimizer(SGD), make_mesh(1, 4, 2), "full_shard", rules=rules, min_shard_size=0)
    spec = {row.path: tuple(row.spec) + (None,) * (len(row.shape) - len(row.spec)) for row in built.plan.rows}
    for adapter, weight in ((gu, f"{moe}/w_gate"), (dn, f"{moe}/w_down")):
        w, a, b = spec[weight], spec[f"{adapter}/lora_a"], spec[f"{adapter}/lora_b"]
        assert w[1] == "tensor" and "fsdp" in w, w
        assert a == w[:3] + (None,) and b == (w[0], w[1], None, w[3]), (weight, w, a, b)


def _flat(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


@pytest.mark.slow
@pytest.mark.parametrize("kind", KINDS)
def test_base_as_without_adapters_step_zero_the_base_and_the_factored_form_the_merged_weights(kind):
    cfg = KINDS[kind]()
    model, plain = trainer_model(cfg, "none", SPEC), from_nnx(lambda r: Decoder(cfg, rngs=r))
    # each model's init and apply one compiled program (both sides of every comparison jitted alike)
    apply, plain_apply = jax.jit(model.apply), jax.jit(plain.apply)
    params = jax.jit(model.init)(jax.random.key(0))
    base, _ = lora_lib.split(params)
    assert max_abs_diff(jax.jit(plain.init)(jax.random.key(0)), base) == 0.0
    t = np.asarray(tokens(cfg))[:, :-1]
    np.testing.assert_array_equal(np.asarray(apply(params, t)), np.asarray(plain_apply(base, t)))
    params = nonzero_b(params)
    base, adapters = lora_lib.split(jax.tree.map(np.asarray, params))
    merged = peft.merge(base, adapters, cfg, SPEC)
    got, want = np.asarray(apply(params, t)), np.asarray(plain_apply(merged, t))
    assert np.abs(got - want).max() < 2e-5 * np.abs(want).max()
    only_attention = peft.merge(base, adapters, cfg, dataclasses.replace(SPEC, targets=lora_lib.ATTENTION))
    assert np.abs(want - np.asarray(plain_apply(only_attention, t))).max() > 1e-3  # the experts' adapters act


MESHES = {
    "fsdp8": ((1, 8, 1), None, "dropless"),
    "fsdp8-capacity": ((1, 8, 1), None, "capacity"),
    "fsdp4-experts-over-tensor2": ((1, 4, 2), {**DEFAULT_RULES, "expert": "tensor"}, "dropless"),
    "experts-over-data2-fsdp4": ((2, 4, 1), {**DEFAULT_RULES, "expert": "data"}, "dropless"),
    "experts-over-data2-capacity": ((2, 4, 1), {**DEFAULT_RULES, "expert": "data"}, "capacity"),
}
# The parities' positions: a device's 12 x k token rows (1 row of 12 per device on 8) match no
# expert tensor dim (16 x k = d_model), so the fsdp8 parities' compiled steps also serve the
# search for frozen expert gradients (test_no_gradient_...): one compile per kind for both.
# Parity does not depend on the length (the capacity kind's C = N holds at any N).
SEQ = 12
_REFERENCES: dict = {}


def _reference(cfg, spec, seq):
    """test_lora_moe.dropout_reference (shared with its tests) at 16 positions; at `seq` others,
    the same computed here once per (cfg, spec, seq)."""
    if seq == 16:
        return dropout_reference(cfg, spec)
    if (cfg, spec, seq) not in _REFERENCES:
        model = trainer_model(cfg, "none", spec)
        loss_fn = make_loss_fn(model, cfg, dropout=True)
        p0 = nonzero_b(jax.jit(model.init)(jax.random.key(0)))
        base, ad0 = lora_lib.split(p0)
        data, run_key = [tokens(cfg, seq=seq, seed=s) for s in range(3)], jax.random.key(5)
        ref_ad, ref_losses = reference_train(loss_fn, base, ad0, data, run_key)
        _REFERENCES[cfg, spec, seq] = (model, loss_fn, p0, base, ad0, data, run_key, ref_ad, ref_losses)
    return _REFERENCES[cfg, spec, seq]


def _parity(cfg, spec, mesh, rules, seq):
    """lora_trains_on_8_devices_as_on_one's run and checks; returns (built, the (state, batch)
    its step last ran on, adapters, reference adapters, start)."""
    model, loss_fn, p0, base, ad0, data, run_key, ref_ad, ref_losses = _reference(cfg, spec, seq)
    built = build(
        model, lora_optimizer(SGD), make_mesh(*mesh), "full_shard", loss_fn=loss_fn, has_aux=True, rules=rules,
        trainable=lora_lib.adapter_mask, rng=run_key, min_shard_size=0, max_replicated_fraction=None,
    )  # fmt: skip
    state, losses = built.place(p0), []
    for b in data:
        state, metrics = built.train_step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got_base, got_ad = lora_lib.split(state.params)
    assert max_abs_diff(got_ad, ref_ad) < 1e-5
    assert max_abs_diff(got_base, base) == 0.0
    return built, (state, data[0]), got_ad, ref_ad, ad0


def lora_trains_on_8_devices_as_on_one(cfg, spec, mesh, rules, seq=16):
    """3 SGD steps of `cfg`'s LoRA model (dropout on) on `mesh` under full_shard against the
    one-device reference (tests/test_lora_moe.reference_train): losses within 1e-5, adapters
    within 1e-5, the base unchanged bit for bit (the reference trained once per (cfg, spec, seq):
    test_lora_moe.dropout_reference at 16 positions); returns (adapters, reference adapters, start)."""
    return _parity(cfg, spec, mesh, rules, seq)[2:]


_RUNS: dict = {}


def expert_parity(name):
    """MESHES[name]'s parity at SEQ positions, run and checked once per module: (adapters, start,
    the text of the compiled step it ran on a (1, 8, 1) mesh, else None)."""
    if name not in _RUNS:
        mesh, rules, kind = MESHES[name]
        built, args, got_ad, _, ad0 = _parity(KINDS[kind](), SPEC, mesh, rules, SEQ)
        hlo = built.train_step.lower(*args).compile().as_text() if mesh == (1, 8, 1) else None
        _RUNS[name] = (got_ad, ad0, hlo)
    return _RUNS[name]


@pytest.mark.slow
@pytest.mark.parametrize("name", MESHES)
def test_expert_lora_trains_on_8_devices_as_on_one(name):
    got_ad, ad0, _ = expert_parity(name)
    assert max_abs_diff(got_ad, ad0) > 1e-3  # the expert adapters moved


@pytest.mark.parametrize("kind", ["dropless", "capacity"])
@pytest.mark.slow
def test_no_gradient_of_a_frozen_expert_tensors_shape_in_the_compiled_step(kind):
    """The adapters' step computes no result of an expert tensor's shape (one expert's, all
    of a layer's, or the stack's) by a dot, scatter or reduction; training everything does.
    The adapters' step is the fsdp8 parity's own compile (`expert_parity`); training
    everything is the same build with no frozen leaf and plain SGD."""
    cfg = KINDS[kind]()
    e, d, f, layers = cfg.n_experts, cfg.d_model, cfg.moe_ffn_dim, cfg.n_layers
    one = {(d, f), (f, d)}
    shapes = one | {(e,) + s for s in one} | {(layers, e) + s for s in one}
    fsdp8 = "fsdp8" if kind == "dropless" else f"fsdp8-{kind}"
    found = {"lora": weight_shaped_results(expert_parity(fsdp8)[2], shapes)}
    model, loss_fn, *_, run_key, _, _ = _reference(cfg, SPEC, SEQ)
    built = build(
        model, SGD, make_mesh(1, 8, 1), "full_shard", loss_fn=loss_fn, has_aux=True, rng=run_key, min_shard_size=0,
        max_replicated_fraction=None,
    )  # fmt: skip
    hlo = built.train_step.lower(built.abstract_state, tokens(cfg, seq=SEQ)).compile().as_text()
    found["full"] = weight_shaped_results(hlo, shapes)
    assert found["lora"] == [], found["lora"][:4]
    assert found["full"], "training everything computes the expert tensors' gradients: the search finds them"


def test_adapter_count_and_flops_count_a_tokens_experts_only():
    cfg = moe_cfg(mlp_only_layers=(1,))
    e, k, d, f, r = cfg.n_experts, cfg.experts_per_token, cfg.d_model, cfg.moe_ffn_dim, SPEC.rank
    attention = lora_lib.adapter_param_count(cfg, dataclasses.replace(SPEC, targets=lora_lib.ATTENTION))
    per_expert = r * (d + 2 * f) + r * (f + d)
    assert lora_lib.adapter_param_count(cfg, SPEC) == attention + 2 * e * per_expert  # 2 sparse layers
    assert lora_lib.adapter_param_count(cfg, SPEC, active=True) == attention + 2 * k * per_expert
    matmul = count_params(cfg, active=True) - cfg.vocab_size * cfg.d_model
    scores = flops_per_token(cfg, 16) - 6 * matmul
    want = 4 * matmul + 6 * (attention + 2 * k * per_expert) + scores
    assert flops_per_token(cfg, 16, SPEC) == pytest.approx(want)


@pytest.mark.parametrize(
    "model,targets,dropout,key,words",
    [
        ("mixtral", "q_proj gate_proj", 0.0, "lora.targets", ("gate_proj and up_proj", "fused")),
        ("mixtral", "down_proj", 0.1, "lora.dropout", ("no dropout", "lora.dropout=0")),
        (
            "mixtral",
            "q_proj shared_expert_gate",
            0.0,
            "lora.targets",
            ("shared_expert_gate names nothing", "o_proj gate_proj up_proj down_proj"),
        ),
        ("qwen2_moe", "up_proj", 0.0, "lora.targets", ("gate_proj and up_proj", "lora.target_parameters")),
    ],
    ids=["gate-without-up", "dropout-on-experts", "names-nothing", "shared-gate-without-up"],
)
def test_expert_targets_peft_cannot_express_are_refused_in_one_line(
    model, targets, dropout, key, words, tmp_path, capsys
):
    from pathlib import Path

    from helpers import call, one_line

    golden = Path(__file__).parent / "golden" / "hf" / model
    over = ["lora.rank=4", f"lora.targets={targets}", f"lora.dropout={dropout}", "data.seq_len=16"]
    over += [f"init_from=hf:{golden}", f"run_dir={tmp_path / 'run'}"]
    rc, _, err = call("train", "--config", "configs/hf_tiny_finetune.yaml", *over, capsys=capsys)
    one_line(rc, err, key, *words)
    assert not (tmp_path / "run").exists()
    spec = lora_lib.LoraSpec(4, 8.0, lora_lib.resolve_targets(targets), dropout=dropout)
    cfg = moe_cfg(shared_expert_ffn_dim=32) if model == "qwen2_moe" else moe_cfg()
    with pytest.raises(ConfigError, match=words[0]), nnx.use_eager_sharding(False):
        Decoder(cfg, rngs=nnx.Rngs(0), lora=spec)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe", "qwen2_moe"])  # qwen3/qwen2_moe: dense layers
def test_a_run_with_expert_adapters_trains_and_exports_peft_and_merged(family, corpus, tmp_path, capsys):
    """The trainer on a tiny Mixtral / Qwen3-MoE / Qwen2-MoE with all-linear adapters (the experts'
    among them; Qwen2-MoE's dense layers and shared expert too):
    `--peft` writes PEFT's expert keys and target_parameters, reading back bit for bit; `--hf`
    writes the merged base, whose logits a plain decoder reloads equal to the LoRA model's;
    the router, norms, biases and (Mixtral, Qwen3-MoE) dense MLP layers are the base's bytes,
    every adapted tensor changed.
    PEFT and transformers load these exports (`make_peft_goldens.py --check-peft`,
    `make_hf_family_goldens.py --check`: docs/lora.md has the figures)."""
    import json
    from pathlib import Path

    from fsdp_jax.app.hf import load as hf
    from fsdp_jax.app.trainer.loop import train
    from fsdp_jax.app.trainer.setup import load_run_config
    from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile
    from helpers import TINY_RUN_OVERRIDES, call

    golden = Path(__file__).parent / "golden" / "hf" / family
    run_dir = tmp_path / "run"
    over = [o for o in TINY_RUN_OVERRIDES if not o.startswith("model.")] + ["train.steps=3", "train.checkpoint_every=3"]
    over += [f"data.path={corpus}", f"run_dir={run_dir}", f"init_from=hf:{golden}", "remat=none"]
    over += ["lora.rank=4", "lora.alpha=8", "lora.targets=all-linear"]
    summary = train(load_run_config(Path("configs/hf_tiny_finetune.yaml").resolve(), over), progress=False)
    state = jax.device_get(summary["run"].state)
    for flag, out in (("--peft", "adapter"), ("--hf", "merged")):
        rc, _, err = call("export", str(run_dir), flag, str(tmp_path / out), capsys=capsys)
        assert rc == 0, err
    raw = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert raw["target_parameters"] == ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    linear = family == "qwen2_moe"  # its dense layers and shared expert too (PEFT's target_modules)
    mlp = ["down_proj", "gate_proj", "shared_expert_gate", "up_proj"] if linear else []
    assert sorted(raw["target_modules"]) == sorted(["k_proj", "o_proj", "q_proj", "v_proj"] + mlp)
    f = SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors")
    cfg = hf.HFCheckpoint(golden).config
    assert sum(".mlp.experts." in k for k in f.tensors) == 4 * sum(cfg.sparse_layers())
    spec = dataclasses.replace(SPEC, targets=lora_lib.TARGETS)  # all-linear
    back = peft.read_peft(tmp_path / "adapter", cfg, spec)
    assert max_abs_diff(back, lora_lib.split(state.params)[1]) == 0.0
    t = np.asarray(tokens(cfg))[:, :-1]
    want = np.asarray(jax.jit(trainer_model(cfg, "none", spec).apply)(state.params, t))
    assert np.abs(merged_logits(tmp_path / "merged", t) - want).max() < 1e-4
    ours, theirs = (SafetensorsFile(d / "model.safetensors") for d in (tmp_path / "merged", golden))
    for k in theirs.tensors:
        proj = k.endswith(("proj.weight", "shared_expert_gate.weight"))
        adapted = ".experts." in k or (proj and ("self_attn" in k or (linear and ".mlp." in k)))
        assert np.array_equal(ours.read(k), theirs.read(k)) != adapted, k
