"""The trainer's decoder with its sequences split over the `context` mesh axis: loss and
gradients on packed long documents equal one device's (f32) under every strategy and
with context 2, 4 and 8; every family's attention options (qk norm, soft caps, GQA/MQA,
query_pre_attn_scalar, sliding-window patterns, llama3 RoPE) go through the ring; the
compiled step shards activations over `context` and passes K/V as the config says."""

import dataclasses
import re

import jax
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_jax as fj
from fsdp_jax.app.data.packing import batch_from_rows, pack
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.trainer.build import make_loss_fn, trainer_model
from helpers import reference_train

SGD = optax.sgd(0.3, momentum=0.9)
SEQ = 64
BASE = DecoderConfig(
    vocab_size=128, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=SEQ, rope_theta=500.0
)
FAMILIES = {
    "llama": BASE,
    "gemma3_like": dataclasses.replace(
        BASE,
        qk_norm=True,
        attn_softcap=20.0,
        final_softcap=15.0,
        query_pre_attn_scalar=12.0,
        sliding_window=9,
        global_every=2,
        rope_local_theta=100.0,
        norm_plus_one=True,
        sandwich_norm=True,
    ),
    "mqa_window_llama3": dataclasses.replace(
        BASE,
        n_kv_heads=1,
        sliding_window=7,
        qkv_bias=True,
        rope_type="llama3",
        rope_factor=8.0,
        rope_original_max_len=16,
    ),
}


def packed_batches(n: int, batch: int = 4, seed: int = 0):
    """Packed rows of long documents (some cut across rows, lengths 5..60), as dicts."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        examples = []
        while sum(len(t) for t, _ in examples) < batch * SEQ * 0.9:
            n_tok = int(rng.integers(5, 61))
            examples.append((rng.integers(0, 128, n_tok), np.ones(n_tok, np.uint8)))
        tok, msk, seg = pack(examples, SEQ)
        b = batch_from_rows(tok[:batch], msk[:batch], seg[:batch])
        out.append({k: jax.numpy.asarray(v) for k, v in b.items()})
    return out


def build(cfg, mesh_kw, strategy):
    model = trainer_model(cfg)
    return fj.build(model, SGD, fj.make_mesh(**mesh_kw), strategy, loss_fn=make_loss_fn(model))


def train(cfg, mesh_kw, strategy, batches, built=None):
    """(built, state, losses, grad norms) of one step per batch; `built` a `build` of the same
    config, mesh and strategy to train with (its compiled init and step reused)."""
    built = built or build(cfg, mesh_kw, strategy)
    state, losses, norms = built.init_state(jax.random.key(0)), [], []
    for b in batches:
        state, metrics = built.train_step(state, jax.device_put(b, built.plan.batch))
        losses.append(float(metrics["loss"]))
        norms.append(float(metrics["grad_norm"]))
    return built, state, losses, norms


def reference(cfg, batches):
    model = trainer_model(cfg)
    loss_fn = make_loss_fn(model)

    def mean_loss(p, b):
        total = loss_fn(p, b)
        return total.total / total.count

    params = jax.jit(model.init)(jax.random.key(0))
    grads = [jax.jit(jax.grad(mean_loss))(params, batches[0])]
    ref_params, losses = reference_train(mean_loss, SGD, params, batches)
    return ref_params, losses, float(optax.tree.norm(grads[0]))


def rel(a, b) -> float:
    return max(
        float(np.max(np.abs(np.asarray(x) - np.asarray(y))) / (np.max(np.abs(np.asarray(y))) + 1e-30))
        for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b))
    )


MESHES = {
    ("full_shard", 2): dict(fsdp=4, context=2),
    ("full_shard", 4): dict(fsdp=2, context=4),
    ("full_shard", 8): dict(fsdp=1, context=8),
    ("shard_grad_op", 4): dict(fsdp=2, context=4),
    ("shard_opt", 2): dict(fsdp=4, context=2),
    ("no_shard", 4): dict(fsdp=2, context=4),
    ("hybrid_shard", 2): dict(data=2, fsdp=2, context=2),
}
FAST = {("full_shard", 4)}  # the rest run with the slow tests (~15 s each on 2 busy cores)


@pytest.fixture(scope="module")
def base_fs4():
    """BASE built full_shard on (fsdp 2, context 4), K/V all-gathered (BASE's default): the
    strategy test's (full_shard, 4) and the compiled-step test's all_gather case, one step."""
    return build(BASE, MESHES["full_shard", 4], "full_shard")


@pytest.fixture(scope="module")
def base_reference():
    """One device's run of BASE on the strategy tests' batches, shared by every mesh."""
    return reference(BASE, packed_batches(2) * 2)


@pytest.mark.parametrize(
    "strategy, context", [pytest.param(*k, marks=() if k in FAST else pytest.mark.slow) for k in MESHES]
)
@pytest.mark.slow
def test_loss_and_grads_equal_one_device_under_every_strategy(strategy, context, base_reference, request):
    batches = packed_batches(2) * 2  # seen twice: the loss must fall on the second pass
    ref_params, ref_losses, ref_norm = base_reference
    shared = request.getfixturevalue("base_fs4") if (strategy, context) == ("full_shard", 4) else None
    built, state, losses, norms = train(BASE, MESHES[strategy, context], strategy, batches, built=shared)
    assert built.mesh.shape["context"] == context
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms[0], ref_norm, rtol=1e-5)
    assert rel(state.params, ref_params) <= 1e-5
    assert losses[2] < losses[0] and losses[3] < losses[1]


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gemma3_like", "mqa_window_llama3"])
def test_every_familys_attention_options_through_the_ring(family):
    batches = packed_batches(2, seed=1)
    cfg = dataclasses.replace(FAMILIES[family], context_kv_pass="ring")
    ref_params, ref_losses, ref_norm = reference(cfg, batches)
    _, state, losses, norms = train(cfg, dict(fsdp=2, context=4), "full_shard", batches)
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms[0], ref_norm, rtol=1e-5)
    assert rel(state.params, ref_params) <= 1e-5


@pytest.mark.parametrize("kv_pass", ["ring", "all_gather"])
@pytest.mark.fast_cases("ring")
def test_compiled_step_shards_the_sequence_and_passes_kv_as_configured(kv_pass, request):
    cfg = dataclasses.replace(BASE, context_kv_pass=kv_pass)
    assert BASE.context_kv_pass == "all_gather"  # base_fs4 is the all_gather case
    shared = kv_pass == "all_gather"
    built = request.getfixturevalue("base_fs4") if shared else build(cfg, dict(fsdp=2, context=4), "full_shard")
    assert built.plan.batch.spec == P(("data", "fsdp"))  # context ranks share a batch shard
    # ZeRO over every data-parallel device, context ranks included
    assert built.plan.params["blocks"]["mlp"]["w_up"].spec == P(None, ("fsdp", "context"), None)
    batch = jax.device_put(packed_batches(1)[0], built.plan.batch)
    hlo = built.train_step.lower(built.init_state(jax.random.key(0)), batch).compile().as_text()
    permutes = re.findall(r"collective-permute(?:-start)?\(", hlo)
    assert bool(permutes) == (kv_pass == "ring")
    # the layer loop's activations are (B / fsdp, S / context, D) = (2, 16, 32): never a whole row
    body = [ln for ln in hlo.splitlines() if "/while/" in ln]
    assert any("f32[2,16,32]" in ln for ln in body)
    assert not any(re.search(r"f32\[2,64,32\]", ln) for ln in body)


@pytest.mark.slow
def test_verify_accepts_context_parallel_strategies():
    """`fsdp_jax.verify` with context=4: every listed strategy on a (fsdp 2, context 4) mesh
    against one device, the trainer's zig-zag loss on packed rows."""
    from fsdp_jax.verify.run import verify

    model = trainer_model(BASE)
    loss_fn = make_loss_fn(model)

    def mean_loss(p, b):
        t = loss_fn(p, b)
        return t.total / t.count

    report = verify(
        model,
        SGD,
        mean_loss,
        batches=packed_batches(2),
        steps=2,
        strategies=["full_shard", "no_shard"],
        check_init=False,
        context=4,
    )
    assert report.passed, report.failed
    assert set(report.strategies) == {"full_shard", "no_shard"}
    fs = report.strategies["full_shard"]
    assert fs.mesh["context"] == 4 and max(fs.loss_rel_diff) <= 1e-5 and max(fs.param_rel_diff) <= 1e-5, fs
