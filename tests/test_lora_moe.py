"""LoRA on mixture-of-experts models: adapters on the attention projections of every layer
(sparse and dense alike), stacked with their segment (the experts' adapters:
tests/test_lora_experts.py). Pinned: the base drawn as without adapters, step 0 the base, the
factored form equal to the merged weights (`peft.merge`), parity of 8 devices (FSDP and
expert parallelism) with one device under dropout, and PEFT's key names for a tiny Mixtral."""

import dataclasses
import functools
from pathlib import Path

import jax
import numpy as np
import optax
import pytest

from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.hf import peft
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import Decoder
from fsdp_jax.app.models.stack import segments
from fsdp_jax.app.trainer.build import lora_optimizer, make_loss_fn, trainer_model
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rule_table import DEFAULT_RULES
from fsdp_jax.train.build import build
from helpers import max_abs_diff

GOLDEN = Path(__file__).parent / "golden" / "hf"
SPEC = lora_lib.LoraSpec(rank=4, alpha=8.0, targets=lora_lib.ATTENTION, dropout=0.2)
SGD = optax.sgd(0.1, momentum=0.9)
EP = {**DEFAULT_RULES, "expert": "tensor"}


def moe_cfg(**kw):
    base = dict(
        vocab_size=64, d_model=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
        n_experts=4, experts_per_token=2, moe_ffn_dim=48, norm_topk_prob=True, router_aux_loss_coef=0.02,
    )  # fmt: skip
    return DecoderConfig(**{**base, **kw})


LAYOUTS = {
    "mixtral": lambda: hf.HFCheckpoint(GOLDEN / "mixtral").config,  # every layer sparse: one segment
    "runs": lambda: moe_cfg(mlp_only_layers=(1,)),  # sparse, dense, sparse: three segments
    "groups_of_2": lambda: moe_cfg(n_layers=4, decoder_sparse_step=2),  # (dense, sparse) x 2
    "unscanned": lambda: moe_cfg(mlp_only_layers=(1,), scan_layers=False),
}


def tokens(cfg, n=8, seq=16, seed=1):
    return jax.random.randint(jax.random.key(seed), (n, seq + 1), 0, cfg.vocab_size)


@functools.partial(jax.jit, static_argnames="seed")  # one program per tree, not a draw per leaf
def nonzero_b(params, seed=3):
    keys = iter(jax.random.split(jax.random.key(seed), 256))
    return jax.tree_util.tree_map_with_path(
        lambda p, x: 0.05 * jax.random.normal(next(keys), x.shape, x.dtype) if lora_lib.is_adapter(p) else x, params
    )


@pytest.mark.slow
@pytest.mark.parametrize("layout", LAYOUTS)
def test_base_as_without_adapters_step_zero_the_base_and_the_factored_form_the_merged_weights(layout):
    cfg = LAYOUTS[layout]()
    if layout == "groups_of_2":
        assert [len(kinds) for _, kinds, _ in segments(cfg)] == [2]
    model, plain = trainer_model(cfg, "none", SPEC), from_nnx(lambda r: Decoder(cfg, rngs=r))
    # each model's init and apply one compiled program (both sides of every comparison jitted alike)
    apply, plain_apply = jax.jit(model.apply), jax.jit(plain.apply)
    params = jax.jit(model.init)(jax.random.key(0))
    base, adapters = lora_lib.split(params)
    assert max_abs_diff(jax.jit(plain.init)(jax.random.key(0)), base) == 0.0
    assert {p.split("/lora/")[1].split("/")[0] for p in _paths(adapters)} == set(lora_lib.ATTENTION)
    t = np.asarray(tokens(cfg))[:, :-1]
    np.testing.assert_array_equal(np.asarray(apply(params, t)), np.asarray(plain_apply(base, t)))
    params = nonzero_b(params)
    base, adapters = lora_lib.split(jax.device_get(params))
    merged = peft.merge(jax.tree.map(np.asarray, base), jax.tree.map(np.asarray, adapters), cfg, SPEC)
    got, want = np.asarray(apply(params, t)), np.asarray(plain_apply(merged, t))
    assert np.abs(got - want).max() < 2e-5 * np.abs(want).max()
    assert np.abs(got - np.asarray(plain_apply(base, t))).max() > 1e-3  # the adapters act
    key = jax.random.key(4)  # dropout (training) changes the output; no key leaves it alone
    assert np.abs(np.asarray(apply(params, t, dropout_key=key)) - got).max() > 1e-4


def _paths(tree):
    return ["/".join(str(getattr(k, "key", k)) for k in p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


def reference_train(loss_fn, base, adapters, data, run_key):
    """One device, `jax.grad` over the adapters (router terms included), step s's key fold_in(run_key, s)."""

    def loss(a, b, key):
        return loss_fn(lora_lib.join(base, a), b, rng=key)[0]

    @jax.jit
    def step(a, s, b, key):
        value, g = jax.value_and_grad(loss)(a, b, key)
        u, s = SGD.update(g, s, a)
        return optax.apply_updates(a, u), s, value

    dev = jax.devices()[0]
    adapters = jax.device_put(adapters, dev)
    opt, losses = SGD.init(adapters), []
    for i, b in enumerate(data):
        adapters, opt, value = step(adapters, opt, jax.device_put(b, dev), jax.random.fold_in(run_key, i))
        losses.append(float(value))
    return adapters, losses


_REFERENCES: dict = {}


def dropout_reference(cfg, spec):
    """`cfg`'s LoRA model under `spec` with dropout, its start (B drawn), 3 batches, the run key, and
    the one-device reference trained on them (`reference_train`): computed once per (cfg, spec) for
    every mesh compared with it. Returns (model, loss_fn, p0, base, ad0, data, run_key, ref_ad,
    ref_losses)."""
    if (cfg, spec) not in _REFERENCES:
        model = trainer_model(cfg, "none", spec)
        loss_fn = make_loss_fn(model, cfg, dropout=True)
        p0 = nonzero_b(jax.jit(model.init)(jax.random.key(0)))
        base, ad0 = lora_lib.split(p0)
        data, run_key = [tokens(cfg, seed=s) for s in range(3)], jax.random.key(5)
        ref_ad, ref_losses = reference_train(loss_fn, base, ad0, data, run_key)
        _REFERENCES[cfg, spec] = (model, loss_fn, p0, base, ad0, data, run_key, ref_ad, ref_losses)
    return _REFERENCES[cfg, spec]


@pytest.mark.slow
@pytest.mark.parametrize("mesh,rules", [((1, 8, 1), None), ((1, 4, 2), EP)], ids=["fsdp8", "fsdp4-experts2"])
def test_moe_lora_with_dropout_trains_on_8_devices_as_on_one(mesh, rules):
    model, loss_fn, p0, base, _, data, run_key, ref_ad, ref_losses = dropout_reference(
        moe_cfg(mlp_only_layers=(1,)), SPEC
    )
    built = build(
        model,
        lora_optimizer(SGD),
        make_mesh(*mesh),
        "full_shard",
        loss_fn=loss_fn,
        has_aux=True,
        rules=rules,
        trainable=lora_lib.adapter_mask,
        rng=run_key,
        min_shard_size=0,
        max_replicated_fraction=None,
    )
    state, losses = built.place(p0), []
    for b in data:
        state, metrics = built.train_step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    got_base, got_ad = lora_lib.split(state.params)
    assert max_abs_diff(got_ad, ref_ad) < 1e-5
    assert max_abs_diff(got_base, base) == 0.0


@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.fast_cases("scanned")
def test_peft_export_of_a_tiny_mixtral_has_peft_key_names_and_reads_back_bit_for_bit(scan, tmp_path):
    cfg = hf.HFCheckpoint(GOLDEN / "mixtral", base=DecoderConfig(scan_layers=scan)).config
    model = trainer_model(cfg, "none", SPEC)
    _, adapters = lora_lib.split(jax.tree.map(np.asarray, nonzero_b(jax.jit(model.init)(jax.random.key(0)))))
    tensors = peft.to_peft(adapters, cfg, SPEC)
    want = {
        f"base_model.model.model.layers.{i}.self_attn.{m}.lora_{h}.weight"
        for i in range(cfg.n_layers)
        for m in ("q_proj", "k_proj", "v_proj", "o_proj")
        for h in "AB"
    }
    assert set(tensors) == want
    assert tensors["base_model.model.model.layers.1.self_attn.k_proj.lora_B.weight"].shape == (
        cfg.n_kv_heads * cfg.head_dim,
        SPEC.rank,
    )
    peft.write_peft(tmp_path / "adapter", adapters, cfg, SPEC)
    again = peft.read_peft(tmp_path / "adapter", cfg, SPEC)
    assert jax.tree.structure(again) == jax.tree.structure(adapters)
    assert max_abs_diff(again, adapters) == 0.0
    raw = peft.read_config(tmp_path / "adapter")
    assert sorted(raw["target_modules"]) == ["k_proj", "o_proj", "q_proj", "v_proj"] and raw["lora_dropout"] == 0.2


@pytest.mark.parametrize("targets", ["all-linear", "q_proj,v_proj", "gate_proj,up_proj", "down_proj"])
def test_targets_on_a_mixture_of_experts_model_pass_the_config_check(targets):
    """Attention and expert targets alike (the experts' refusals: tests/test_lora_experts.py)."""
    from fsdp_jax.app.config import load_config, validate

    cfg = load_config("configs/tiny.yaml", ["lora.rank=4", f"lora.targets={targets}"])
    moe = dataclasses.replace(cfg.model, n_experts=4, experts_per_token=2, moe_ffn_dim=64)
    validate(dataclasses.replace(cfg, model=moe))


def test_moe_lora_flops_and_adapter_count():
    from fsdp_jax.app.models.decoder import count_params, flops_per_token

    cfg = moe_cfg(mlp_only_layers=(1,))
    model = trainer_model(cfg, "none", SPEC)
    n = sum(x.size for x in jax.tree.leaves(lora_lib.split(model.abstract_params)[1]))
    assert n == lora_lib.adapter_param_count(cfg, SPEC)
    matmul = count_params(cfg, active=True) - cfg.vocab_size * cfg.d_model
    attention = flops_per_token(cfg, 16) - 6 * matmul
    assert flops_per_token(cfg, 16, SPEC) == pytest.approx(4 * matmul + 6 * n + attention)


@pytest.mark.parametrize("layout", ["groups_of_2", "runs"])
@pytest.mark.slow
def test_scanned_segments_draw_each_layers_dropout_mask_as_the_unscanned_layers_do(layout):
    """Layer l's dropout key is the same whether l sits in a scanned segment's group or in the
    unscanned list: the same params (rearranged), the same key, the same logits."""
    from fsdp_jax.app.models.stack import segment_layers

    cfg = LAYOUTS[layout]()
    flat = dataclasses.replace(cfg, scan_layers=False)
    scanned = trainer_model(cfg, "none", SPEC)
    params = jax.tree.map(np.asarray, nonzero_b(jax.jit(scanned.init)(jax.random.key(0))))
    per_layer = {}
    for prefix, layers, _ in segment_layers(cfg):
        node = params
        for k in prefix.split("/"):
            node = node[int(k) if k.isdigit() else k]
        for g, layer in enumerate(layers):
            per_layer[layer] = jax.tree.map(lambda x, g=g: x[g], node)
    unscanned = {**{k: v for k, v in params.items() if k != "segments"}, "segments": per_layer}
    t, key = tokens(cfg)[:, :-1], jax.random.key(9)
    apply = jax.jit(scanned.apply)  # one compiled program per model, not op by op
    got = np.asarray(apply(params, t, dropout_key=key))
    want = np.asarray(jax.jit(trainer_model(flat, "none", SPEC).apply)(unscanned, t, dropout_key=key))
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()
    assert np.abs(got - np.asarray(apply(params, t))).max() > 1e-4


@pytest.mark.slow
def test_a_mixtral_lora_run_trains_and_exports_peft_and_merged(corpus, tmp_path, capsys):
    """The trainer on the tiny Mixtral with attention adapters and dropout: it trains, `--peft`
    writes PEFT's names, `--hf` writes the merged base, whose logits a plain decoder reloads
    equal to the LoRA model's; the expert tensors are the base's bytes."""
    from fsdp_jax.app.trainer.loop import train
    from fsdp_jax.app.trainer.setup import load_run_config
    from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile
    from helpers import TINY_RUN_OVERRIDES, call

    run_dir = tmp_path / "run"
    over = [o for o in TINY_RUN_OVERRIDES if not o.startswith("model.")] + ["train.steps=3", "train.checkpoint_every=3"]
    over += [f"data.path={corpus}", f"run_dir={run_dir}", f"init_from=hf:{GOLDEN / 'mixtral'}", "remat=none"]
    over += ["lora.rank=4", "lora.alpha=8", "lora.targets=q_proj,k_proj,v_proj,o_proj", "lora.dropout=0.1"]
    summary = train(load_run_config(Path("configs/hf_tiny_finetune.yaml").resolve(), over), progress=False)
    state = jax.device_get(summary["run"].state)
    for flag, out in (("--peft", "adapter"), ("--hf", "merged")):
        rc, _, err = call("export", str(run_dir), flag, str(tmp_path / out), capsys=capsys)
        assert rc == 0, err
    f = SafetensorsFile(tmp_path / "adapter" / "adapter_model.safetensors")
    assert len(f.tensors) == 2 * 4 * 2 and all(".self_attn." in k for k in f.tensors)
    base_cfg = hf.HFCheckpoint(GOLDEN / "mixtral").config
    spec = lora_lib.LoraSpec(4, 8.0, lora_lib.ATTENTION, dropout=0.1)
    back = peft.read_peft(tmp_path / "adapter", base_cfg, spec)
    assert max_abs_diff(back, lora_lib.split(state.params)[1]) == 0.0
    t = np.asarray(tokens(base_cfg))[:, :-1]
    want = np.asarray(jax.jit(trainer_model(base_cfg, "none", spec).apply)(state.params, t))
    assert np.abs(merged_logits(tmp_path / "merged", t) - want).max() < 1e-4
    ours, theirs = (SafetensorsFile(d / "model.safetensors") for d in (tmp_path / "merged", GOLDEN / "mixtral"))
    for k in theirs.tensors:
        assert np.array_equal(ours.read(k), theirs.read(k)) == ("self_attn" not in k or "norm" in k), k


def merged_logits(directory, t) -> np.ndarray:
    """The logits of a plain decoder (no adapters) on the HF checkpoint `directory`."""
    merged = hf.HFCheckpoint(directory)
    plain = from_nnx(lambda r: Decoder(merged.config, rngs=r))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plain.abstract_params)
    return np.asarray(jax.jit(plain.apply)(hf.load_params(merged, abstract), t))
