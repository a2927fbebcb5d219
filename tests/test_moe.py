"""Mixture-of-experts decoder (models/moe.py, models/stack.py) against transformers' own
Mixtral, Qwen3-MoE and Qwen2-MoE (tests/golden/make_hf_moe_goldens.py): logits, the
load-balancing aux loss, the loss with its coefficient; the layer layout, capacity mode,
compiled FLOPs and collectives, router metrics; export round trips; bad input."""

from __future__ import annotations

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_hf import GOLDEN, MESHES, index_and_shapes, saved_run

from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.hf.config_in import model_config_from_hf
from fsdp_jax.app.hf.export import export_hf
from fsdp_jax.app.models import Decoder, DecoderConfig, count_params
from fsdp_jax.app.models import moe as moe_lib
from fsdp_jax.app.models.decoder import cross_entropy
from fsdp_jax.app.models.stack import segment_layers, segments, sparse_layers
from fsdp_jax.app.trainer.build import make_loss_fn
from fsdp_jax.checkpoint import CheckpointError
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from fsdp_jax.errors import ConfigError
from fsdp_jax.hlo.memory import collective_report
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.rule_table import DEFAULT_RULES
from fsdp_jax.train.build import build
from fsdp_jax.train.step import sharding_context
from helpers import call, one_line

MOE = ("mixtral", "qwen3_moe", "qwen2_moe")


def golden(name):
    f = SafetensorsFile(GOLDEN / f"{name}_logits.safetensors")
    return {k: f.read(k) for k in f.tensors}


def imported(path, strategy="full_shard", mesh_shape=(1, 8, 1), scan=True, rules=None):
    ckpt = hf.HFCheckpoint(path, base=DecoderConfig(scan_layers=scan))
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    built = build(m, optax.sgd(0.1), make_mesh(*mesh_shape), strategy, min_shard_size=0, rules=rules)
    return hf.load_params(ckpt, built.abstract_state.params), m, built.plan, ckpt.config


def forward(params, m, plan, tokens, mask):
    """(logits, the aux loss of its RouterStats) of the golden's 2 rows, tiled to 8 (every batch
    sharding divides), without a token mask and with `mask`: both applies and aux losses in one
    compiled program (not the aux loss op by op)."""
    t, mk = jax.device_put((np.tile(tokens, (4, 1)), np.tile(mask, (4, 1))))  # not jnp.asarray's `stage` compiles

    def with_aux(logits, stats):
        return logits, moe_lib.aux_loss(stats)

    def both(p, t, mk):
        return with_aux(*m.apply(p, t, router=True)), with_aux(*m.apply(p, t, router=True, token_mask=mk))

    with sharding_context(plan):
        outs = jax.jit(both)(params, t, mk)
    return [(np.asarray(logits)[: len(tokens)], aux) for logits, aux in outs]


def check(name, **kw):
    g = golden(name)
    params, m, plan, cfg = imported(GOLDEN / name, **kw)
    (logits, aux), (logits_m, aux_m) = forward(params, m, plan, g["tokens"], g["attention_mask"])
    err = float(np.abs(logits - g["logits"]).max())
    assert err < 1e-4, (name, kw, err)
    # tiling the rows 4 times leaves every mean of the aux loss unchanged
    assert abs(float(aux) - float(g["aux_loss"])) < 1e-5, (name, kw)
    assert abs(float(aux_m) - float(g["aux_loss_masked"])) < 1e-5, (name, kw)
    keep = g["attention_mask"].astype(bool)  # padding rows of logits are not compared
    assert float(np.abs(logits_m - g["logits_masked"])[keep].max()) < 1e-4
    return params, m, plan, cfg, g


@pytest.mark.parametrize("name", MOE)
@pytest.mark.slow
def test_moe_import_matches_transformers_logits_and_aux_loss(name):
    params, m, plan, cfg, g = check(name)
    check(name, scan=False, mesh_shape=(1, 4, 2))
    # transformers' .loss = lm_loss + router_aux_loss_coef * aux_loss
    raw = json.loads((GOLDEN / name / "config.json").read_text())
    assert cfg.router_aux_loss_coef == raw["router_aux_loss_coef"]
    lm = float(jax.jit(cross_entropy)(jnp.asarray(g["logits"][:, :-1]), jnp.asarray(g["tokens"][:, 1:])))
    assert abs(lm - float(g["lm_loss"])) < 1e-5
    assert abs(lm + cfg.router_aux_loss_coef * float(g["aux_loss"]) - float(g["loss"])) < 1e-5
    # the trainer's loss adds exactly that term, with the aux loss of the tokens it sees
    batch = jnp.asarray(np.tile(g["tokens"], (4, 1)))
    loss_fn = make_loss_fn(m, cfg)

    def loss_and_formula(p, b):  # the loss and, from an independent apply, its formula's terms
        logits, stats = m.apply(p, b[:, :-1], router=True)
        return loss_fn(p, b), cross_entropy(logits, b[:, 1:]), moe_lib.aux_loss(stats)

    with sharding_context(plan):  # one compiled program, not the formula op by op
        (loss, aux), ce, router_aux = jax.jit(loss_and_formula)(params, batch)
    want = float(ce) + cfg.router_aux_loss_coef * float(router_aux)
    assert abs(float(loss) - want) < 1e-6
    assert abs(float(aux["router_aux_loss"]) - float(router_aux)) < 1e-6
    assert abs(float(jnp.sum(aux["expert_load"])) - 1.0) < 1e-6 and float(aux["dropped_tokens"]) == 0.0


EP = {**DEFAULT_RULES, "expert": "tensor"}


@pytest.mark.parametrize("name", MOE)
def test_expert_parallel_import_matches_transformers(name):
    """Experts split over the tensor axis (2 per device group of the golden's 4, 8, 6):
    each device holds and computes E / 2 experts; logits and aux loss as transformers'."""
    params, *_ = check(name, mesh_shape=(1, 4, 2), rules=EP)
    leaf = [p for k, p in _flat(params).items() if k.endswith("moe/w_gate")][0]
    assert leaf.sharding.spec[1] == "tensor"  # (layers, expert, embed, mlp): experts split
    assert leaf.addressable_shards[0].data.shape[1] == leaf.shape[1] // 2


def _flat(tree):
    return {
        "/".join(str(getattr(k, "key", k)) for k in path): v for path, v in jax.tree_util.tree_leaves_with_path(tree)
    }


def _placement(name, strategy):
    """What `check(name, strategy=...)`'s forward program depends on besides the checkpoint: the
    params' shardings and the plan's mesh and logical rules (`sharding_context`)."""
    ckpt = hf.HFCheckpoint(GOLDEN / name, base=DecoderConfig(scan_layers=True))
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    built = build(m, optax.sgd(0.1), make_mesh(*MESHES[strategy]), strategy, min_shard_size=0)
    return jax.tree.map(lambda x: x.sharding, built.abstract_state.params), built.plan.mesh, built.plan.rules


# full_shard on (1, 8, 1), scanned, default rules is `check(name)` exactly, which
# test_moe_import_matches_transformers_logits_and_aux_loss runs first for each family; no_shard places
# the params as shard_opt does (replicated, the same mesh and rules), so its check is shard_opt's
# program on the same inputs: the shard_opt case asserts that placement (a build, no compile).
@pytest.mark.slow
@pytest.mark.parametrize("strategy", [s for s in MESHES if s not in ("full_shard", "no_shard")])
@pytest.mark.parametrize("name", MOE)
def test_moe_import_matches_transformers_every_strategy(name, strategy):
    check(name, strategy=strategy, mesh_shape=MESHES[strategy])
    if strategy == "shard_opt":
        assert _placement(name, "no_shard") == _placement(name, "shard_opt")


def test_sparse_layer_rule_and_segments():
    q2 = model_config_from_hf(json.loads((GOLDEN / "qwen2_moe" / "config.json").read_text()))
    q3 = model_config_from_hf(json.loads((GOLDEN / "qwen3_moe" / "config.json").read_text()))
    assert sparse_layers(q2) == (False, True, False)  # decoder_sparse_step=2
    assert sparse_layers(q3) == (True, False, True)  # mlp_only_layers=[1]
    # 3 layers, no shorter period: one group of all 3 (as many bodies as 3 runs; the tie goes to one scan)
    assert segments(q3) == ((0, (True, False, True), 1),)
    # a periodic pattern is one scanned segment of groups (qwen2 step 2 over 8 layers)
    q2_8 = dataclasses.replace(q2, n_layers=8)
    assert segments(q2_8) == ((0, (False, True), 4),)
    assert segment_layers(q2_8)[1] == ("segments/0/layers/1", [1, 3, 5, 7], True)
    every = dataclasses.replace(q3, n_layers=6, mlp_only_layers=())
    assert segments(every) == ((0, (True,), 6),)
    # 48 layers, one dense: three runs, not a 48-layer group
    big = dataclasses.replace(q3, n_layers=48, mlp_only_layers=(20,))
    assert [s[2] for s in segments(big)] == [20, 1, 27]


def _moe_cfg(**kw):
    base = dict(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
        n_experts=8, experts_per_token=2, moe_ffn_dim=48, norm_topk_prob=True,
    )  # fmt: skip
    return DecoderConfig(**{**base, **kw})


def _ref_moe(x, router, wg, wu, wd, k, norm, cap=None):
    """Every expert on every token, weighted by the router (numpy, float64): an independent
    reference of the sparse MLP; `cap` drops pairs over capacity in token-major order."""
    x, router, wg, wu, wd = (np.asarray(a, np.float64) for a in (x, router, wg, wu, wd))
    logits = x @ router
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    top = np.argsort(-p, axis=-1, kind="stable")[:, :k]
    w = np.take_along_axis(p, top, -1)
    w = w / w.sum(-1, keepdims=True) if norm else w
    out, filled, dropped = np.zeros_like(x), np.zeros(wg.shape[0], int), 0
    for t in range(len(x)):
        for j in range(k):
            e = top[t, j]
            if cap is not None and filled[e] >= cap:
                dropped += 1
                continue
            filled[e] += 1
            g, u = x[t] @ wg[e], x[t] @ wu[e]
            out[t] += w[t, j] * ((g / (1 + np.exp(-g))) * u) @ wd[e]
    return out, dropped


@pytest.mark.parametrize("factor", [0.0, 4.0, 1.0, 0.5])
def test_moe_layer_dropless_and_capacity_against_a_dense_reference(factor):
    cfg = _moe_cfg(capacity_factor=factor)
    layer = _layer(cfg)
    x = jax.random.normal(jax.random.key(3), (2, 16, cfg.d_model))
    graph, state = nnx.split(layer)
    y, stats = jax.jit(lambda s, x: nnx.merge(graph, s)(x))(state, x)  # one compile, not one per op
    cap = moe_lib.capacity(32, 2, 8, factor) if factor else None
    want, dropped = _ref_moe(
        x.reshape(32, -1), layer.router[...], layer.w_gate[...], layer.w_up[...], layer.w_down[...], 2, True, cap
    )
    assert np.abs(np.asarray(y).reshape(32, -1) - want).max() < 1e-5
    assert float(stats.dropped) == dropped
    if factor in (0.0, 4.0):  # dropless, or capacity N (4 = E / k): nothing dropped
        assert dropped == 0
    if factor == 0.5:  # half the slots the pairs need
        assert dropped >= 32
    assert float(stats.counts.sum()) == 32 * 2 and float(stats.tokens) == 32


def _layer(cfg):
    """The MoE layer of `cfg` drawn by one compiled init, not one compile per op of an eager one."""
    with nnx.use_eager_sharding(False):
        return nnx.jit(lambda: moe_lib.MoE(cfg, nnx.Rngs(0)))()


def _moe_layer_flops(cfg, n_tokens=256):
    layer = _layer(cfg)
    graph, state = nnx.split(layer)
    f = jax.jit(lambda s, x: nnx.merge(graph, s)(x)[0])
    x = jax.ShapeDtypeStruct((1, n_tokens, cfg.d_model), jnp.float32)
    return f.lower(state, x).compile().cost_analysis()["flops"]


@pytest.mark.slow
def test_capacity_mode_compiled_flops_scale_with_top_k():
    """Capacity mode (capacity 1.0) computes top_k / n_experts of the dense all-experts
    MLP; XLA:CPU's cost analysis of the compiled layer, router and dispatch included."""
    cfg = _moe_cfg(d_model=256, moe_ffn_dim=512, capacity_factor=1.0)
    sparse = _moe_layer_flops(cfg)
    dense = _moe_layer_flops(dataclasses.replace(cfg, experts_per_token=8, capacity_factor=1.0))
    # top-8 of 8 experts at capacity 1.0: every token through every expert, the dense form
    assert sparse <= 1.3 * (2 / 8) * dense, (sparse, dense)


def test_full_shard_gathers_each_moe_layer_inside_the_loop():
    cfg = _moe_cfg(n_layers=4, mlp_only_layers=(), d_model=64)
    m = from_nnx(lambda r: Decoder(cfg, rngs=r, remat="full"))
    built = build(m, optax.sgd(0.1), make_mesh(1, 8, 1), "full_shard", loss_fn=make_loss_fn(m, cfg), has_aux=True)
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=built.plan.batch)
    compiled = built.train_step.lower(built.abstract_state, batch).compile()
    rep = collective_report(compiled.as_text())
    inside = rep["inside_loop"]["all-gather"]["op_names"]
    fwd = [n for n in inside if "transpose(" not in n]
    bwd = [n for n in inside if "transpose(" in n]
    # 4 attention + router + 3 expert weights per layer, in the forward and backward loops
    assert len(fwd) >= 8 and len(bwd) >= 8, inside
    # tokens are routed on the device that holds them (models/moe.py per_batch_shard):
    # no all-to-all, and outside the loop only the embedding table and head are gathered
    assert "all-to-all" not in rep["inside_loop"] and "all-to-all" not in rep["outside_loop"]
    assert rep["outside_loop"]["all-gather"]["count"] <= 2


def test_count_params_counts_experts_and_active_params():
    cfg = _moe_cfg(shared_expert_ffn_dim=16, mlp_only_layers=(1,))
    params = from_nnx(lambda r: Decoder(cfg, rngs=r)).abstract_params
    assert count_params(cfg) == sum(int(np.prod(p.shape)) for p in jax.tree.leaves(params))
    per_expert = 3 * cfg.d_model * cfg.moe_ffn_dim
    assert count_params(cfg) - count_params(cfg, active=True) == (8 - 2) * per_expert  # one sparse layer


@pytest.mark.parametrize("name", MOE)
@pytest.mark.slow
def test_moe_export_round_trips_bit_exact(tmp_path, name):
    ck, params = saved_run(tmp_path, name)
    out = tmp_path / "hf_out"
    export_hf(ck, out)
    assert index_and_shapes(out)[1] == index_and_shapes(GOLDEN / name)[1]  # per-expert names and shapes
    got, want = (json.loads((p / "config.json").read_text()) for p in (out, GOLDEN / name))
    for k, v in want.items():
        if k not in ("transformers_version", "dtype", "max_window_layers", "output_router_logits"):
            if k == "sliding_window" and not want.get("use_sliding_window", True):
                assert not got[k]  # Qwen2-MoE's 0 or null: no window either way
            elif not (k == "head_dim" and v is None):  # Mixtral's null: hidden / heads, which we write
                assert got.get(k) == v, (k, got.get(k), v)
    assert got["head_dim"] == want.get("head_dim") or want["hidden_size"] // want["num_attention_heads"]
    back, *_ = imported(out, strategy="hybrid_shard", mesh_shape=(2, 4, 1))
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(back)):
        assert np.array_equal(np.asarray(a), np.asarray(b))


def _edit(src, dst, **changes):
    shutil.copytree(src, dst)
    raw = json.loads((dst / "config.json").read_text())
    raw.update(changes)
    (dst / "config.json").write_text(json.dumps(raw))
    return dst


def test_bad_moe_configs_are_refused_by_name(tmp_path):
    mix = GOLDEN / "mixtral"
    with pytest.raises(ConfigError, match="num_experts_per_tok=5: top-k larger than num_local_experts=4"):
        hf.HFCheckpoint(_edit(mix, tmp_path / "a", num_experts_per_tok=5))
    with pytest.raises(ConfigError, match="allowed for model_type deepseek_v3: DeepseekV3ForCausalLM"):
        hf.HFCheckpoint(_edit(mix, tmp_path / "b", model_type="deepseek_v3"))  # tests/test_deepseek_v3.py
    with pytest.raises(ConfigError, match="allowed for model_type gpt_oss: GptOssForCausalLM"):
        hf.HFCheckpoint(_edit(mix, tmp_path / "c", model_type="gpt_oss"))  # a family now (tests/test_gpt_oss.py)
    with pytest.raises(ConfigError, match="scoring_func='sigmoid'"):
        hf.HFCheckpoint(_edit(GOLDEN / "qwen3_moe", tmp_path / "d", scoring_func="sigmoid"))
    with pytest.raises(ConfigError, match="router_jitter_noise"):
        hf.HFCheckpoint(_edit(mix, tmp_path / "e", router_jitter_noise=0.1))
    problem = moe_lib.moe_config_problem(_moe_cfg(experts_per_token=9))
    assert problem == ("experts_per_token", 9, "must be in [1, n_experts=8]")


def _rewrite(src, dst, drop=None, reshape=None):
    shutil.copytree(src, dst)
    f = SafetensorsFile(src / "model.safetensors")
    tensors = {n: f.read(n) for n in f.tensors if n != drop}
    if reshape:
        tensors[reshape] = tensors[reshape][:-1]
    (dst / "model.safetensors").unlink()
    entries = [(n, t.shape, t.dtype) for n, t in tensors.items()]
    write_safetensors(dst / "model.safetensors", entries, tensors.__getitem__)
    return dst


def test_missing_or_misshapen_expert_tensors_are_refused(tmp_path):
    name = "model.layers.1.block_sparse_moe.experts.3.w2.weight"
    with pytest.raises(CheckpointError, match=f"tensor {name} is missing"):
        hf.HFCheckpoint(_rewrite(GOLDEN / "mixtral", tmp_path / "a", drop=name))
    with pytest.raises(CheckpointError, match=rf"tensor {name} has shape \[63, 96\], config.json implies \[64, 96\]"):
        hf.HFCheckpoint(_rewrite(GOLDEN / "mixtral", tmp_path / "b", reshape=name))


# config.json of mistralai/Mixtral-8x7B-v0.1 and Qwen/Qwen3-30B-A3B as published
MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "model_type": "mixtral",
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "router_aux_loss_coef": 0.02,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.36.0.dev0",
    "use_cache": True,
    "vocab_size": 32000,
}
QWEN3_30B_A3B = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "max_window_layers": 48,
    "mlp_only_layers": [],
    "model_type": "qwen3_moe",
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000.0,
    "router_aux_loss_coef": 0.001,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}


@pytest.mark.parametrize(
    "yaml_name, raw, total, active",
    [
        ("mixtral_8x7b", MIXTRAL_8X7B, 46_702_792_704, 12_879_925_248),
        ("qwen3_30b_a3b", QWEN3_30B_A3B, 30_532_122_624, 3_353_032_704),
    ],
)
def test_shipped_moe_configs_are_the_published_models(yaml_name, raw, total, active):
    from fsdp_jax.app.config import load_config

    cfg = load_config(GOLDEN.parents[1].parent / "configs" / f"{yaml_name}.yaml")
    assert cfg.model == model_config_from_hf(raw, base=cfg.model)
    assert count_params(cfg.model) == total  # 46.7B / 30.5B, as published
    assert count_params(cfg.model, active=True) == active


def test_bad_moe_input_is_one_line_exit_2(tmp_path, capsys):
    """The train command on bad MoE input: one line naming the field, exit 2, nothing written."""
    run = tmp_path / "run"
    base = ["--config", "configs/mixtral_8x7b.yaml", f"run_dir={run}", f"data.path={tmp_path / 'd'}"]
    rc, _, err = call("train", *base, "model.experts_per_token=9", capsys=capsys)
    one_line(rc, err, "model.experts_per_token", "9", "n_experts=8")
    rc, _, err = call("train", *base, "model.capacity_factor=-1", capsys=capsys)
    one_line(rc, err, "model.capacity_factor")
    deepseek = _edit(GOLDEN / "mixtral", tmp_path / "ds", model_type="deepseek_v3")
    rc, _, err = call("train", *base, f"init_from=hf:{deepseek}", capsys=capsys)
    one_line(rc, err, "architectures", "DeepseekV3ForCausalLM")
    assert not run.exists()


def _losses(cfg, mesh, strategy, rules=None, steps=3):
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    built = build(
        m, optax.sgd(0.5), mesh, strategy, loss_fn=make_loss_fn(m, cfg), has_aux=True, rules=rules, min_shard_size=0
    )
    state = built.init_state(jax.random.key(0))
    batch = jax.random.randint(jax.random.key(1), (8, 17), 0, cfg.vocab_size)
    out = []
    for _ in range(steps):
        state, metrics = built.train_step(state, batch)
        out.append(float(metrics["loss"]))
    return np.asarray(out)


# Both modes (three compiled runs each, ~19 s in a whole run's junit) run in the whole suite only; the
# fast subset keeps dropless under full_shard and over the tensor axis in the golden imports above (a
# mutation of the dropless experts' offset fails both: BENCHMARKS.md "Issue 55 item 6, the fast subset").
@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
@pytest.mark.slow
def test_train_steps_match_one_device_under_fsdp_and_expert_parallelism(capacity_factor):
    """3 SGD steps (f32, aux loss on) of a 3-layer MoE with a dense middle layer: losses on
    one device, under full_shard (8-way fsdp) and with experts over the tensor axis agree."""
    cfg = _moe_cfg(n_layers=3, mlp_only_layers=(1,), capacity_factor=capacity_factor, router_aux_loss_coef=0.01)
    one = _losses(cfg, make_mesh(1, 1, 1, devices=jax.devices()[:1]), "full_shard")
    assert one[-1] < one[0]  # it learns
    # capacity is per batch shard: compare capacity mode where every shard holds the whole
    # batch (experts split only), dropless everywhere
    meshes = [((1, 1, 8), EP)] if capacity_factor else [((1, 8, 1), None), ((1, 4, 2), EP)]
    for shape, rules in meshes:
        got = _losses(cfg, make_mesh(*shape), "full_shard", rules)
        assert np.abs(got / one - 1).max() <= 1e-5, (shape, got, one)


def test_expert_axis_must_divide_the_experts():
    cfg = _moe_cfg(n_experts=6)
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    built = build(m, optax.sgd(0.1), make_mesh(1, 2, 4), "full_shard", rules=EP, min_shard_size=0)
    with (
        sharding_context(built.plan),
        pytest.raises(ValueError, match="n_experts=6 is not divisible by the expert mesh axes tensor"),
    ):
        jax.eval_shape(m.apply, built.abstract_state.params, jnp.zeros((8, 8), jnp.int32))


@pytest.mark.slow
def test_packed_rows_loss_and_router_metrics_summary():
    """Packed rows: the router sees the real tokens only (segment 0 is padding) and the loss
    is the weighted cross-entropy plus coef x aux; the logged window summarises the steps'
    router aux (loads from the (E,) shares, dropped per step)."""
    from fsdp_jax.app.data.packing import batch_from_rows
    from fsdp_jax.app.trainer.build import token_loss
    from fsdp_jax.app.trainer.router_metrics import summarise

    cfg = _moe_cfg(router_aux_loss_coef=0.1)
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    params = jax.jit(m.init)(jax.random.key(0))  # jitted here and below: a compile each, not one per op
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, cfg.vocab_size, (2, 16))
    seg = np.array([[1] * 9 + [2] * 5 + [0] * 2, [1] * 12 + [0] * 4])
    batch = {k: jnp.asarray(v) for k, v in batch_from_rows(tokens, np.ones_like(tokens), seg).items()}

    def loss_and_formula(p, b):  # the loss and, from an independent apply, its formula
        mask = b["segment_ids"] > 0
        logits, stats = m.apply(p, b["inputs"], b["segment_ids"], b["positions"], router=True, token_mask=mask)
        ts = token_loss(logits, b["targets"], b["weights"])
        (total, count), aux = make_loss_fn(m, cfg)(p, b)
        return (total / count, aux), ts.total / ts.count + 0.1 * moe_lib.aux_loss(stats), stats.tokens

    (loss, aux), want, routed = jax.jit(loss_and_formula)(params, batch)  # one program, not op by op
    assert float(routed) == 2 * 26  # 2 sparse layers; the padding's 6 tokens are not routed
    assert abs(float(loss) - float(want)) < 1e-6
    rec = summarise([aux, {**aux, "dropped_tokens": jnp.asarray(4.0)}])
    load = np.asarray(aux["expert_load"])
    assert rec["expert_load_min"] == pytest.approx(load.min()) and rec["expert_load_max"] == pytest.approx(load.max())
    assert rec["expert_load_imbalance"] == pytest.approx(load.max() * 8) and rec["dropped_tokens"] == 2.0
    assert rec["router_aux_loss"] == pytest.approx(float(aux["router_aux_loss"]))
