"""Multi-token prediction (models/mtp.py, objectives/mtp.py, hf/mtp_layout.py): the loss against
the DeepSeek-V3 report's formula written out plainly here, every strategy against one device, the
`mtp_loss` metric, DeepSeek-V3's checkpoint layout out and back, bad input."""

from __future__ import annotations

import dataclasses
import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from test_deepseek_v3 import golden
from test_hf import GOLDEN, saved_run

from fsdp_jax.app.config.checks import validate
from fsdp_jax.app.config.parse import config_to_dict, load_config
from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.hf.export import export_hf
from fsdp_jax.app.models import Decoder, DecoderConfig, count_params
from fsdp_jax.app.trainer.build import make_loss_fn
from fsdp_jax.app.trainer.init_from import base_loader, open_hf_init
from fsdp_jax.app.trainer.router_metrics import summarise
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.checkpoint import Checkpointer
from fsdp_jax.errors import ConfigError
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from helpers import TINY_RUN_OVERRIDES, call, one_line

CFG = DecoderConfig(
    vocab_size=48, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16, scan_layers=False
)
MTP = dataclasses.replace(CFG, mtp_depth=2, mtp_loss_weight=0.3)
STRATEGIES = {  # strategy: mesh (data, fsdp, tensor)
    "full_shard": (1, 8, 1),
    "shard_grad_op": (1, 8, 1),
    "shard_opt": (1, 8, 1),
    "no_shard": (8, 1, 1),
    "hybrid_shard": (2, 4, 1),
}


def _rms(x, w, eps):  # numpy, float64: no eager op (a compile per shape) in the reference
    x = np.asarray(x, np.float64)
    return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps) * np.asarray(w, np.float64)


def _ce(logits, target):  # one row's cross-entropy, log-sum-exp written out
    m = logits.max()
    return float(m + np.log(np.exp(logits - m).sum()) - logits[target])


def _block(block, h):
    """`block(h)`, jitted: one compile for every block of the reference (they share a graph and
    shapes), not one per op of an eager call."""
    graph, state = nnx.split(block)
    return _merged_call(graph, state, h)


@functools.partial(jax.jit, static_argnums=0)
def _merged_call(graph, state, h):
    return nnx.merge(graph, state)(h)


def reference_loss(model: Decoder, batch: np.ndarray) -> tuple[float, float]:
    """(L_main + lambda / D * sum_k L_MTP^k, mean_k L_MTP^k) by the report's eq. 21-25 with the
    model's own blocks (their attention is pinned against transformers elsewhere): depth k at
    position i concatenates RMSNorm(Emb(t_{i+k})) and RMSNorm(h^{k-1}_i), projects by M_k, runs
    its block, the shared head after its norm, and scores t_{i+k+1} over the i that have one."""
    cfg = model.cfg
    tokens, s = batch[:, :-1], batch.shape[1] - 1
    emb, head = np.asarray(model.embed[...]), np.asarray(model.head[...])
    h = jnp.asarray(emb[tokens])
    for blk in model.blocks:
        h = _block(blk, h)
    logits = np.asarray(_rms(np.asarray(h), np.asarray(model.final_norm.scale[...]), cfg.norm_eps) @ head)
    main = np.mean([_ce(logits[b, i], batch[b, i + 1]) for b in range(len(batch)) for i in range(s)])
    per_depth = []
    for k in range(1, cfg.mtp_depth + 1):
        mod = model.mtp[k - 1]
        e = np.zeros_like(emb[tokens])
        e[:, : s - k] = emb[tokens[:, k:]]  # Emb(t_{i+k})
        x = np.concatenate(
            [
                _rms(e, np.asarray(mod.enorm.scale[...]), cfg.norm_eps),
                _rms(np.asarray(h), mod.hnorm.scale[...], cfg.norm_eps),
            ],
            axis=-1,
        )
        h = _block(mod.block, jnp.asarray(x @ np.asarray(mod.eh_proj[...])))
        lk = np.asarray(_rms(np.asarray(h), np.asarray(mod.norm.scale[...]), cfg.norm_eps) @ head)
        per_depth.append(np.mean([_ce(lk[b, i], batch[b, i + k + 1]) for b in range(len(batch)) for i in range(s - k)]))
    mtp = float(np.mean(per_depth))
    return float(main + cfg.mtp_loss_weight * mtp), mtp


def _drawn(cfg):
    """`Decoder(cfg, rngs=nnx.Rngs(0))` from one compiled init, not one compile per op of an eager one."""
    with nnx.use_eager_sharding(False):
        return nnx.jit(lambda: Decoder(cfg, rngs=nnx.Rngs(0)))()


@pytest.fixture(scope="module")
def tiny():
    model = _drawn(MTP)
    batch = np.asarray(jax.random.randint(jax.random.key(1), (8, 17), 0, MTP.vocab_size))
    return model, batch


def test_loss_is_the_reports_formula(tiny):
    model, batch = tiny
    fns = from_nnx(lambda r: Decoder(MTP, rngs=r))
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    loss, aux = jax.jit(make_loss_fn(fns, MTP))(params, jnp.asarray(batch))
    want, want_mtp = reference_loss(model, batch)
    assert abs(float(aux["mtp_loss"]) - want_mtp) < 1e-5 * want_mtp
    assert abs(float(loss) - want) < 1e-5 * want
    assert float(aux["mtp_loss"]) > 0 and count_params(MTP) == sum(x.size for x in jax.tree.leaves(params))
    # the model's own params draw as without MTP; MTP adds only its modules
    base = nnx.to_pure_dict(nnx.state(_drawn(CFG), nnx.Param))  # drawn alike, by a compiled init
    for a, b in zip(jax.tree.leaves(base), jax.tree.leaves({k: params[k] for k in base})):
        assert np.array_equal(a, b)


@pytest.mark.slow  # 5 strategies x a compiled step (~30 s idle)
def test_every_strategy_trains_as_one_device():
    """2 SGD steps: loss and mtp_loss of each strategy over 8 devices equal one device's."""
    fns = from_nnx(lambda r: Decoder(dataclasses.replace(MTP, scan_layers=True), rngs=r))
    batch = jax.random.randint(jax.random.key(1), (8, 17), 0, MTP.vocab_size)

    def run(strategy, mesh):
        loss_fn = make_loss_fn(fns, MTP)
        built = build(fns, optax.sgd(0.5), mesh, strategy, loss_fn=loss_fn, has_aux=True, min_shard_size=0)
        state, out = built.init_state(jax.random.key(0)), []
        for _ in range(2):
            state, m = built.train_step(state, batch)
            out.append((float(m["loss"]), float(m["aux"]["mtp_loss"])))
        return np.asarray(out)

    one = run("full_shard", make_mesh(1, 1, 1, devices=jax.devices()[:1]))
    assert one[1, 0] < one[0, 0] and one[1, 1] < one[0, 1]
    for strategy, shape in STRATEGIES.items():
        got = run(strategy, make_mesh(*shape))
        assert np.abs(got / one - 1).max() <= 1e-5, (strategy, got, one)


def test_metric_window_logs_mtp_loss():
    rec = summarise([{"mtp_loss": np.float32(2.0)}, {"mtp_loss": np.float32(3.0)}])
    assert rec == {"mtp_loss": 2.5}


@pytest.mark.slow  # a whole train run (~15 s idle)
def test_train_command_logs_mtp_loss(tmp_path, corpus, capsys):
    """`fsdp-jax train` with model.mtp_depth=2: metrics.jsonl carries mtp_loss beside the loss,
    which holds the weighted MTP term (the loss exceeds what mtp_loss alone would leave)."""
    run = tmp_path / "run"
    args = ["--config", "configs/tiny.yaml", *TINY_RUN_OVERRIDES, "model.mtp_depth=2", "train.steps=2"]
    rc, _, err = call("train", *args, f"data.path={corpus}", f"run_dir={run}", capsys=capsys)
    assert rc == 0, err[-3000:]
    recs = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    last = [r for r in recs if "mtp_loss" in r][-1]
    assert np.isfinite(last["mtp_loss"]) and last["mtp_loss"] > 0
    assert last["loss"] > 0.3 * last["mtp_loss"]


NAME = "deepseek_v3"


@pytest.mark.slow  # an import, an export and two imports of the tiny golden (~20 s idle)
def test_deepseek_v3_layout_round_trips_bit_exact(tmp_path):
    """A run with one MTP depth exports it as layer num_hidden_layers (enorm, hnorm, eh_proj,
    shared_head.norm, shared_head.head and embed_tokens copies, the decoder layer's tensors),
    num_nextn_predict_layers 1; imports back bit-exact; a run without MTP reads the same
    directory, leaving that layer out as transformers does."""
    _, base = saved_run(tmp_path, NAME)
    yml = tmp_path / "mtp.yaml"
    yml.write_text(f"init_from: hf:{GOLDEN / NAME}\nmodel: {{mtp_depth: 1}}\ndata: {{seq_len: 32, path: {tmp_path}}}\n")
    run_cfg = load_run_config(yml)
    cfg = run_cfg.model
    init = from_nnx(lambda r: Decoder(cfg, rngs=r)).init

    @jax.jit  # one compile, not one per op of an eager init and per leaf of the noise
    def drawn(key):
        return jax.tree.map(lambda p: p + 1e-3 * jax.random.normal(jax.random.key(4), p.shape), init(key)["mtp"])

    mtp = drawn(jax.random.key(3))
    params = {**base, "mtp": mtp}
    d = tmp_path / "run_mtp" / "checkpoints"
    with Checkpointer(d) as c:
        c.save(7, {"params": params}, {"config": config_to_dict(run_cfg)})
    out = tmp_path / "hf_out"
    export_hf(d, out)
    assert json.loads((out / "config.json").read_text())["num_nextn_predict_layers"] == 1
    f = hf.HFCheckpoint(out, base=dataclasses.replace(cfg, mtp_depth=0))  # also: no extra tensor refused
    n = cfg.n_layers
    eh = f.where[f"model.layers.{n}.eh_proj.weight"].read(f"model.layers.{n}.eh_proj.weight")
    assert np.array_equal(eh, np.asarray(mtp[0]["eh_proj"]).T)
    head = f.where[f"model.layers.{n}.shared_head.head.weight"].read(f"model.layers.{n}.shared_head.head.weight")
    assert np.array_equal(head, np.asarray(base["head"]).T)
    emb = f.where[f"model.layers.{n}.embed_tokens.weight"].read(f"model.layers.{n}.embed_tokens.weight")
    assert np.array_equal(emb, np.asarray(base["embed"]))
    assert f"model.layers.{n}.mlp.experts.7.down_proj.weight" in f.where  # the MTP layer is sparse
    for depth, want in ((1, params), (0, base)):
        ckpt = hf.HFCheckpoint(out, base=dataclasses.replace(cfg, mtp_depth=depth))
        back = hf.load_params(ckpt, from_nnx(lambda r: Decoder(ckpt.config, rngs=r)).abstract_params)
        assert jax.tree.structure(back) == jax.tree.structure(want)
        for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(back)):
            assert np.array_equal(np.asarray(a), np.asarray(b))
    ckpt = hf.HFCheckpoint(GOLDEN / NAME, base=cfg)  # no MTP layer: read only with a fresh init for it
    with pytest.raises(ConfigError, match="model.mtp_depth.*holds 0 MTP layers"):
        hf.load_params(ckpt, from_nnx(lambda r: Decoder(cfg, rngs=r)).abstract_params)


@pytest.mark.slow  # one train-step compile of the golden with an MTP depth (~15 s loaded)
def test_a_depth_the_checkpoint_lacks_starts_fresh_and_exports(tmp_path, capsys):
    """`init_from: hf:` of the golden (no MTP layer) with model.mtp_depth=1, as the trainer loads
    it: one log line, the imported leaves bit-equal to a run without MTP, the new depth the model's
    own init with the run's seed (a fresh run's), a finite step, and an export writes it as layer
    num_hidden_layers."""
    yml = tmp_path / "mtp.yaml"
    yml.write_text(f"init_from: hf:{GOLDEN / NAME}\nmodel: {{mtp_depth: 1}}\ndata: {{seq_len: 32, path: {tmp_path}}}\n")
    run_cfg = load_run_config(yml)
    cfg = run_cfg.model
    m = from_nnx(lambda r: Decoder(cfg, rngs=r))
    built = build(
        m,
        optax.sgd(0.1),
        make_mesh(1, 8, 1),
        "full_shard",
        loss_fn=make_loss_fn(m, cfg),
        has_aux=True,
        min_shard_size=0,
    )
    key = jax.random.key(run_cfg.train.seed)
    capsys.readouterr()
    params = base_loader(run_cfg, None, m.init, key)(built.abstract_state.params)
    out = capsys.readouterr().out
    assert out.count("\n") == 1 and "model.mtp_depth 1" in out and "depth 1 initialised fresh" in out, out
    host = jax.device_get(params)
    plain_ckpt = hf.HFCheckpoint(GOLDEN / NAME, base=dataclasses.replace(cfg, mtp_depth=0))
    plain = hf.load_params(plain_ckpt, from_nnx(lambda r: Decoder(plain_ckpt.config, rngs=r)).abstract_params)
    assert set(host) == {*plain, "mtp"}
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves({k: host[k] for k in plain})):
        assert np.array_equal(np.asarray(a), b)
    fresh = jax.device_get(jax.jit(m.init)(key)["mtp"])
    for a, b in zip(jax.tree.leaves(fresh), jax.tree.leaves(host["mtp"])):
        assert np.array_equal(a, b)
    state, metrics = built.train_step(
        built.state_from_params(params), jnp.asarray(np.tile(golden()["tokens"], (4, 1)), jnp.int32)
    )
    assert np.isfinite(float(metrics["loss"])) and np.isfinite(float(metrics["aux"]["mtp_loss"]))
    d = tmp_path / "run" / "checkpoints"
    with Checkpointer(d) as c:
        c.save(1, {"params": host}, {"config": config_to_dict(run_cfg)})
    export_hf(d, tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    back = hf.HFCheckpoint(tmp_path / "hf", base=cfg)
    n = f"model.layers.{cfg.n_layers}.eh_proj.weight"
    assert np.array_equal(back.where[n].read(n), np.asarray(host["mtp"][0]["eh_proj"]).T)


@pytest.mark.parametrize(
    "override, words",
    [
        (["model.mtp_depth=-1"], ["model.mtp_depth"]),
        (["model.mtp_loss_weight=-0.1"], ["model.mtp_loss_weight"]),
        (["model.mtp_depth=1", "mesh.context=2"], ["model.mtp_depth", "mesh.context 1"]),
        (["model.mtp_depth=1", "objective=dpo"], ["model.mtp_depth", "objective sft"]),
        (["model.mtp_depth=32"], ["model.mtp_depth", "data.seq_len"]),
    ],
)
def test_bad_mtp_settings_are_refused_naming_the_key(override, words):
    with pytest.raises(ConfigError) as e:
        validate(load_config("configs/tiny.yaml", ["data.seq_len=32", "model.max_seq_len=32", *override]))
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_bad_mtp_depth_is_one_line_exit_2(tmp_path, capsys):
    rc, _, err = call("plan", "--config", "configs/tiny.yaml", "--devices", "1", "model.mtp_depth=-2", capsys=capsys)
    one_line(rc, err, "model.mtp_depth")


def test_lora_with_a_depth_the_checkpoint_lacks_is_refused_in_one_line(tmp_path):
    """A fresh MTP depth under LoRA would stay a frozen random block: refused naming model.mtp_depth."""
    yml = tmp_path / "mtp.yaml"
    yml.write_text(f"init_from: hf:{GOLDEN / NAME}\nmodel: {{mtp_depth: 1}}\ndata: {{seq_len: 32, path: {tmp_path}}}\n")
    cfg = load_run_config(yml, ["lora.rank=4", "lora.targets=q_a_proj"])
    with pytest.raises(ConfigError) as e:
        open_hf_init(cfg)
    assert "model.mtp_depth" in str(e.value) and "frozen random block" in str(e.value) and "\n" not in str(e.value)
    assert open_hf_init(load_run_config(yml)).mtp_held == 0  # without LoRA: opened, the depth to start fresh
