"""LoRA on Qwen2-MoE's shared expert and on the dense MLP layers of a mixture of experts, as
PEFT's target_modules put them there (`gate_proj up_proj down_proj` wrap the dense layers'
and the shared expert's nn.Linear, `shared_expert_gate` its (1, D) gate; the routed experts
come by target_parameters). Per-weight adapters sharded as their weight, the factored form
equal to the merged weights, no gradient of a frozen weight's shape in the compiled step,
8 devices train as one, the config's `lora.target_parameters`, refusals in one line. The
peft-written goldens (qwen2_moe, qwen2_moe_shared): tests/test_lora_peft.py."""

import dataclasses

import jax
import numpy as np
import pytest
from test_lora_experts import lora_trains_on_8_devices_as_on_one
from test_lora_moe import SGD, moe_cfg, nonzero_b, tokens

from fsdp_jax.app.hf import peft
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.decoder import Decoder
from fsdp_jax.app.trainer.build import lora_optimizer, make_loss_fn, trainer_model
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding import axes
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rule_table import DEFAULT_RULES
from fsdp_jax.train.build import build
from helpers import max_abs_diff, weight_shaped_results

ALL = lora_lib.LoraSpec(rank=4, alpha=8.0, targets=lora_lib.TARGETS)  # all-linear
SHARED_ONLY = dataclasses.replace(ALL, experts=(), dropout=0.1)  # target_parameters none


def qwen2_moe_cfg(**kw):
    """Layers 0 and 2 dense (ffn 64), layer 1 sparse with a shared expert (width 40)."""
    base = dict(decoder_sparse_step=2, shared_expert_ffn_dim=40, norm_topk_prob=False, qkv_bias=True)
    return moe_cfg(**{**base, **kw})


def _flat(tree):
    return {"/".join(str(getattr(k, "key", k)) for k in p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def test_shared_expert_and_dense_layer_adapters_are_per_weight_and_shard_as_their_weight():
    cfg = qwen2_moe_cfg()
    model = trainer_model(cfg, "none", ALL)
    shapes = {p: x.shape for p, x in _flat(lora_lib.split(model.abstract_params)[1]).items()}
    d, f, fs, r = cfg.d_model, cfg.ffn_dim, cfg.shared_expert_ffn_dim, ALL.rank
    seg = {s: f"segments/0/layers/{m}" for m, s in enumerate(("dense", "sparse"))}  # (dense, sparse) groups
    want = {
        f"{seg['dense']}/mlp/lora/w_gate/lora_a": (1, d, r),
        f"{seg['dense']}/mlp/lora/w_gate/lora_b": (1, r, f),
        f"{seg['dense']}/mlp/lora/w_down/lora_a": (1, f, r),
        f"{seg['sparse']}/moe/shared_lora/w_up/lora_b": (1, r, fs),
        f"{seg['sparse']}/moe/shared_lora/w_down/lora_a": (1, fs, r),
        f"{seg['sparse']}/moe/shared_lora/w_shared_gate/lora_a": (1, d, r),
        f"{seg['sparse']}/moe/shared_lora/w_shared_gate/lora_b": (1, r, 1),
        f"{seg['sparse']}/moe/lora/experts_gate_up/lora_b": (1, cfg.n_experts, r, 2 * cfg.moe_ffn_dim),
    }
    assert {p: shapes.get(p) for p in want} == want
    assert sum(int(np.prod(s)) for s in shapes.values()) == lora_lib.adapter_param_count(cfg, ALL)
    # FSDP x TP: A's input dim as the weight's input dim, B's output dim as its output dim, rank replicated
    built = build(model, lora_optimizer(SGD), make_mesh(1, 4, 2), "full_shard", min_shard_size=0)
    spec = {row.path: tuple(row.spec) + (None,) * (len(row.shape) - len(row.spec)) for row in built.plan.rows}
    moe = f"{seg['sparse']}/moe"
    pairs = [(f"{moe}/shared_lora/{w}", f"{moe}/{p}") for w, p in peft.SHARED_PARAMS.items()]
    pairs += [(f"{seg['dense']}/mlp/lora/{w}", f"{seg['dense']}/mlp/{w}") for w in lora_lib.MLP_WEIGHTS]
    rows = (axes.TENSOR, axes.FSDP)  # DEFAULT_RULES' frozen_rows
    for adapter, weight in pairs:
        w, a, b = spec[weight], spec[f"{adapter}/lora_a"], spec[f"{adapter}/lora_b"]
        if w[1] == rows:  # a frozen w_down: fsdp moved to its leading dim (frozen_rows); adapters shard as it trains
            w = (w[0], "tensor", "fsdp")
        assert a == (w[0], w[1], None) and b == (w[0], None, w[2]), (weight, w, a, b)
    assert any(spec[f"{moe}/shared_{p}"][2] == "tensor" for p in ("gate", "up"))  # a weight TP splits


@pytest.mark.parametrize("spec", [ALL, SHARED_ONLY], ids=["all-linear", "target_parameters-none"])
@pytest.mark.slow
def test_step_zero_is_the_base_and_the_factored_form_is_the_merged_weights(spec):
    cfg = qwen2_moe_cfg()
    model, plain = trainer_model(cfg, "none", spec), from_nnx(lambda r: Decoder(cfg, rngs=r))
    # each model's init and apply one compiled program (both sides of every comparison jitted alike)
    apply, plain_apply = jax.jit(model.apply), jax.jit(plain.apply)
    params = jax.jit(model.init)(jax.random.key(0))
    base, _ = lora_lib.split(params)
    assert max_abs_diff(jax.jit(plain.init)(jax.random.key(0)), base) == 0.0
    t = np.asarray(tokens(cfg))[:, :-1]
    np.testing.assert_array_equal(np.asarray(apply(params, t)), np.asarray(plain_apply(base, t)))
    params = nonzero_b(params)
    base, adapters = lora_lib.split(jax.tree.map(np.asarray, params))
    assert ("experts_down" in str(jax.tree_util.tree_structure(adapters))) == (spec is ALL)
    merged = peft.merge(base, adapters, cfg, spec)
    got, want = np.asarray(apply(params, t)), np.asarray(plain_apply(merged, t))
    assert np.abs(got - want).max() < 2e-5 * np.abs(want).max()
    # each kind acts: without the shared expert's (or the dense layers') adapters merged, other logits
    for drop in (("shared_lora",), ("mlp",)):
        kept = jax.tree_util.tree_map_with_path(
            lambda p, x: 0 * x if any(getattr(k, "key", None) in drop for k in p) else x, adapters
        )
        other = np.asarray(plain_apply(peft.merge(base, kept, cfg, spec), t))
        assert np.abs(want - other).max() > 1e-3, drop
    if spec.dropout:  # the layer's dropout key reaches the shared expert's adapters
        only = jax.tree_util.tree_map_with_path(
            lambda p, x: x if "shared_lora" in jax.tree_util.keystr(p) or not lora_lib.is_adapter(p) else 0 * x,
            jax.tree.map(np.asarray, params),
        )
        key = jax.random.key(4)
        plain_out = np.asarray(apply(only, t))
        assert np.abs(np.asarray(apply(only, t, dropout_key=key)) - plain_out).max() > 1e-4


@pytest.mark.slow
def test_no_gradient_of_a_frozen_shared_expert_or_dense_mlp_weights_shape_in_the_compiled_step():
    """Nothing of a shared expert weight's shape (D, Fs), (Fs, D) or a dense MLP weight's (D, F),
    (F, D) (one layer's or the stack's) comes out of a dot, scatter or reduction of the adapters'
    step; training everything computes them."""
    cfg = qwen2_moe_cfg()
    d, f, fs = cfg.d_model, cfg.ffn_dim, cfg.shared_expert_ffn_dim
    one = {(d, fs), (fs, d), (d, f), (f, d)}
    shapes = one | {(1,) + s for s in one}
    model = trainer_model(cfg, "none", ALL)
    loss_fn = make_loss_fn(model, cfg)
    found = {}
    for name, trainable in (("lora", lora_lib.adapter_mask), ("full", None)):
        built = build(
            model, lora_optimizer(SGD) if trainable else SGD, make_mesh(1, 8, 1), loss_fn=loss_fn, has_aux=True,
            trainable=trainable, min_shard_size=0, max_replicated_fraction=None,
        )  # fmt: skip
        hlo = built.train_step.lower(built.abstract_state, tokens(cfg, seq=12)).compile().as_text()
        found[name] = weight_shaped_results(hlo, shapes)
    assert found["lora"] == [], found["lora"][:4]
    assert {s for s in one if any(f"[{s[0]},{s[1]}]" in line for line in found["full"])} == one


MESHES = [
    ("fsdp8", (1, 8, 1), None, ALL),
    ("fsdp4-experts-over-tensor2", (1, 4, 2), {**DEFAULT_RULES, "expert": "tensor"}, ALL),
    ("fsdp4-tp2-shared-only-dropout", (1, 4, 2), None, SHARED_ONLY),
]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,rules,spec", [m[1:] for m in MESHES], ids=[m[0] for m in MESHES])
def test_shared_expert_lora_trains_on_8_devices_as_on_one(mesh, rules, spec):
    got_ad, ref_ad, ad0 = lora_trains_on_8_devices_as_on_one(qwen2_moe_cfg(), spec, mesh, rules)
    # each shared-expert / dense-layer adapter moved, and agrees with one device to 1% of its move
    got, ref, start = (_flat(jax.tree.map(np.asarray, t)) for t in (got_ad, ref_ad, ad0))
    for p in (p for p in got if "shared_lora" in p or "/mlp/" in p):
        moved = np.abs(ref[p] - start[p]).max()
        assert moved > 1e-5 and np.abs(got[p] - ref[p]).max() < 1e-2 * moved, (p, moved)


def test_target_parameters_resolve_and_count():
    assert lora_lib.resolve_experts("auto") is None and lora_lib.resolve_experts("none") == ()
    assert lora_lib.resolve_experts("mlp.experts.down_proj, gate_up_proj") == ("experts_gate_up", "experts_down")
    cfg = qwen2_moe_cfg()
    only_attention = dataclasses.replace(ALL, targets=lora_lib.ATTENTION, experts=())
    r, d, f, fs = ALL.rank, cfg.d_model, cfg.ffn_dim, cfg.shared_expert_ffn_dim
    dense, shared = 2 * r * 3 * (d + f), r * (3 * (d + fs) + d + 1)  # 2 dense layers, 1 shared expert
    n = lora_lib.adapter_param_count(cfg, SHARED_ONLY)
    assert n == lora_lib.adapter_param_count(cfg, only_attention) + dense + shared
    kv = cfg.n_kv_heads * cfg.head_dim
    assert lora_lib.max_rank(cfg, lora_lib.TARGETS, ()) == min(d, fs, kv)  # the (D, 1) gate takes any rank
    assert lora_lib.max_rank(cfg, ("w_shared_gate",), ()) > 1


@pytest.mark.parametrize(
    "over,key,words",
    [
        (["lora.target_parameters=mlp.experts.up_proj"], "lora.target_parameters", ("up_proj is no expert tensor",)),
        (
            ["lora.targets=gate_proj", "lora.target_parameters=none", "model=mixtral"],
            "lora.targets",
            ("gate_proj names nothing", "it has q_proj k_proj v_proj o_proj"),
        ),
        (
            ["lora.target_parameters=mlp.experts.down_proj", "model=llama3"],
            "lora.target_parameters",
            ("no routed experts",),
        ),
    ],
    ids=["unknown-parameter", "mlp-names-nothing-on-mixtral", "experts-on-a-dense-model"],
)
def test_bad_targets_are_refused_in_one_line(over, key, words, tmp_path, capsys):
    from pathlib import Path

    from helpers import call, one_line

    family = next((o.split("=")[1] for o in over if o.startswith("model=")), "qwen2_moe")
    golden = Path(__file__).parent / "golden" / "hf" / family
    over = [o for o in over if not o.startswith("model=")] + ["lora.rank=4", "data.seq_len=16"]
    over += [f"init_from=hf:{golden}", f"run_dir={tmp_path / 'run'}"]
    rc, _, err = call("train", "--config", "configs/hf_tiny_finetune.yaml", *over, capsys=capsys)
    one_line(rc, err, key, *words)
    assert not (tmp_path / "run").exists()


def test_a_peft_adapter_adapting_other_modules_is_refused_in_one_line():
    """qwen2_moe_shared (no target_parameters) against a run whose experts are adapted, and the
    reverse: each names what the adapter has."""
    from pathlib import Path

    from fsdp_jax.app.hf import load as hf
    from fsdp_jax.errors import CheckpointError

    golden = Path(__file__).parent / "golden"
    cfg = hf.HFCheckpoint(golden / "hf" / "qwen2_moe").config
    spec = dataclasses.replace(ALL, targets=lora_lib.WEIGHTS)
    for name, run, words in (
        ("qwen2_moe_shared", spec, "target_parameters=none, the run's lora.target_parameters differs"),
        ("qwen2_moe", dataclasses.replace(ALL, experts=()), "target_parameters=mlp.experts.down_proj"),
        ("qwen2_moe", spec, "targets=down_proj gate_proj k_proj o_proj q_proj shared_expert_gate up_proj v_proj"),
    ):
        with pytest.raises(CheckpointError) as e:
            peft.read_peft(golden / "peft" / name, cfg, run)
        assert "\n" not in str(e.value) and words in str(e.value), str(e.value)


def test_adapter_tensors_the_model_does_not_adapt_are_refused_not_dropped(tmp_path):
    """A Qwen2-MoE without a shared expert keeps no dense-layer adapters (`linear_mlps`); a PEFT
    adapter carrying them is refused in one line rather than read in part."""
    import shutil
    from pathlib import Path

    from fsdp_jax.app.hf import load as hf
    from fsdp_jax.errors import CheckpointError

    golden = Path(__file__).parent / "golden"
    cfg = dataclasses.replace(hf.HFCheckpoint(golden / "hf" / "qwen2_moe").config, shared_expert_ffn_dim=0)
    d = tmp_path / "a"
    shutil.copytree(golden / "peft" / "qwen2_moe_shared", d)
    spec = dataclasses.replace(ALL, targets=lora_lib.WEIGHTS, experts=())
    with pytest.raises(CheckpointError) as e:
        peft.read_peft(d, cfg, spec)
    msg = str(e.value)
    assert "\n" not in msg and "tensors this model's adapters do not hold" in msg and ".mlp." in msg, msg
