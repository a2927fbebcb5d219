"""LoRA on the reference decoder: the factored form against a merged-weight reference,
adapters sharded as their weights, optimizer state and master copies for adapters only, no
frozen-weight gradient in the compiled backward, and parity with one device under every
strategy and FSDP x TP."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import Decoder, cross_entropy
from fsdp_jax.app.trainer.build import lora_optimizer, trainer_model
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.leaf_sharding import path_str
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from helpers import max_abs_diff, reference_train, token_batches, weight_shaped_results

# every weight dim distinct from the per-device row count (B*S / 8 = 16) and from each other
CFG = DecoderConfig(vocab_size=96, d_model=40, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=56, max_seq_len=16)
SPEC = lora_lib.LoraSpec(rank=4, alpha=8.0)
SGD = optax.sgd(0.05, momentum=0.9)


def lora_model(cfg=CFG, spec=SPEC):
    return trainer_model(cfg, "none", spec)


def loss_of(model):
    def loss_fn(params, tokens):
        return cross_entropy(model.apply(params, tokens[:, :-1]), tokens[:, 1:])

    return loss_fn


@functools.partial(jax.jit, static_argnames="seed")  # one program per tree, not a draw per leaf
def nonzero_b(params, seed=3):
    """B drawn N(0, 0.02) (PEFT's zero B would leave A's first gradient zero)."""
    keys = iter(jax.random.split(jax.random.key(seed), 64))

    def draw(path, x):
        if path_str(path).endswith("lora_b"):
            return 0.02 * jax.random.normal(next(keys), x.shape, x.dtype)
        return x

    return jax.tree_util.tree_map_with_path(draw, params)


def batches(n=3):
    return token_batches(n, batch=8, seq=16, vocab=CFG.vocab_size)


@jax.jit
def _merged_by_hand(base, adapters):
    """`base` with each adapted W replaced by W + s A B (the einsum per weight: one program)."""
    merged = jax.tree.map(lambda x: x, base)
    for mod, names in (("attn", lora_lib.ATTENTION), ("mlp", lora_lib.WEIGHTS[4:])):
        for n in names:
            a, b = adapters["blocks"][mod]["lora"][n]["lora_a"], adapters["blocks"][mod]["lora"][n]["lora_b"]
            w = merged["blocks"][mod][n]
            r = SPEC.rank
            ab = jnp.einsum("lir,lro->lio", a.reshape(a.shape[0], -1, r), b.reshape(b.shape[0], r, -1))
            merged["blocks"][mod][n] = w + SPEC.scale * ab.reshape(w.shape)
    return merged


def test_factored_form_equals_the_merged_weights_and_step_zero_is_the_base():
    model = lora_model()
    # each model's init and apply one compiled program (both sides of every comparison jitted alike)
    apply = jax.jit(model.apply)
    params = jax.jit(model.init)(jax.random.key(0))
    base, adapters = lora_lib.split(params)
    plain = from_nnx(lambda r: Decoder(CFG, rngs=r))
    plain_apply = jax.jit(plain.apply)
    tokens = batches(1)[0][:, :-1]
    # PEFT's init (B = 0): the adapted model is the base, and its base params are the base model's
    assert max_abs_diff(jax.jit(plain.init)(jax.random.key(0)), base) == 0.0
    np.testing.assert_array_equal(apply(params, tokens), plain_apply(base, tokens))
    # with B != 0 the factored y = xW + s (xA) B equals the base model on W + s A B
    params = nonzero_b(params)
    _, adapters = lora_lib.split(params)
    merged = _merged_by_hand(base, adapters)
    got, want = np.asarray(apply(params, tokens)), np.asarray(plain_apply(merged, tokens))
    assert float(np.max(np.abs(got - want))) < 2e-5 * float(np.max(np.abs(want)))
    assert float(np.max(np.abs(got - np.asarray(plain_apply(base, tokens))))) > 1e-3  # the adapters act


def test_adapters_shard_as_their_weights_and_the_rank_dim_is_replicated():
    model = lora_model()
    built = build(model, lora_optimizer(SGD), make_mesh(1, 4, 2), "full_shard", min_shard_size=0)
    spec = {r.path: tuple(r.spec) + (None,) * (len(r.shape) - len(r.spec)) for r in built.plan.rows}
    layers = "blocks/attn"
    assert spec[f"{layers}/wq"] == (None, "fsdp", "tensor", None)
    assert spec[f"{layers}/lora/wq/lora_a"] == (None, "fsdp", None)  # (L, D, r): D as wq's D
    assert spec[f"{layers}/lora/wq/lora_b"] == (None, None, "tensor", None)  # (L, r, H, Dh): H as wq's
    assert spec[f"{layers}/wo"] == (None, "tensor", None, "fsdp")
    assert spec[f"{layers}/lora/wo/lora_a"] == (None, "tensor", None, None)
    assert spec[f"{layers}/lora/wo/lora_b"] == (None, None, "fsdp")
    assert spec["blocks/mlp/lora/w_down/lora_a"] == (None, "tensor", None)
    assert spec["blocks/mlp/lora/w_up/lora_b"] == (None, None, "tensor")


def _state_bytes(tree):
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


@pytest.mark.slow
def test_frozen_base_rests_in_its_dtype_with_no_master_copy_and_no_optimizer_state():
    model = lora_model()
    adam = lora_optimizer(optax.adam(1e-3))
    built = build(
        model,
        adam,
        make_mesh(1, 8, 1),
        loss_fn=loss_of(model),
        precision="params=float32,compute=bfloat16,reduce=float32",
        trainable=lora_lib.adapter_mask,
    )
    params = built.abstract_state.params
    base, adapters = lora_lib.split(params)
    assert {x.dtype for x in jax.tree.leaves(base)} == {jnp.dtype(jnp.bfloat16)}  # no f32 master
    assert {x.dtype for x in jax.tree.leaves(adapters)} == {jnp.dtype(jnp.float32)}
    # Adam's two moments for the adapters, nothing for the base (its step counter aside)
    moments = [x for x in jax.tree.leaves(built.abstract_state.opt_state) if x.ndim]
    assert _state_bytes(moments) == 2 * _state_bytes(adapters)
    state = built.init_state(jax.random.key(0))
    before = jax.tree.map(np.asarray, lora_lib.split(state.params)[0])
    for b in batches(2):
        state, metrics = built.train_step(state, b)
        assert int(metrics["skipped"]) == 0
    after, trained = lora_lib.split(state.params)
    assert max_abs_diff(before, after) == 0.0  # the base leaves the step bit for bit
    assert max_abs_diff(trained, lora_lib.split(built.init_state(jax.random.key(0)).params)[1]) > 0


@pytest.mark.parametrize("precision", ["params=float32,compute=float32", "params=float32,compute=bfloat16"])
@pytest.mark.slow
def test_no_gradient_of_a_frozen_weights_shape_in_the_compiled_backward(precision):
    """LoRA's backward: input gradients through frozen weights, adapter gradients, and no
    dot (or scatter-add, or reduction) producing a frozen weight's gradient. The same step
    training everything shows each of them, so the search would find them."""
    shapes = _frozen_shapes()
    model = lora_model()
    found = {}
    for name, trainable in (("lora", lora_lib.adapter_mask), ("full", None)):
        opt = lora_optimizer(SGD) if trainable else SGD
        built = build(model, opt, make_mesh(1, 8, 1), loss_fn=loss_of(model), precision=precision, trainable=trainable)
        hlo = built.train_step.lower(built.abstract_state, batches(1)[0]).compile().as_text()
        found[name] = weight_shaped_results(hlo, shapes)
    assert found["lora"] == [], found["lora"][:4]
    assert len(found["full"]) >= 7, found["full"]  # one per weight at least


def _frozen_shapes(cfg=CFG):
    d, h, kvh, dh, f, v = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim, cfg.vocab_size
    flat = [(d, h * dh), (d, kvh * dh), (h * dh, d), (d, f), (f, d), (v, d), (d, v)]
    shapes = set(flat) | {(b, a) for a, b in flat}
    return shapes | {(cfg.n_layers,) + s for s in shapes}


_H100_CHILD = r"""
import json, sys
sys.path.insert(0, "tests")
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.trainer.build import lora_optimizer
from fsdp_jax.hlo.costs import op_inventory
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.targets import gpu as targets
from fsdp_jax.train.build import build
from helpers import weight_shaped_results
import test_lora as t

devs = targets.gpu_devices("h100", 1, 8)
mesh, model, shapes, out = make_mesh(1, 8, 1, devices=devs), t.lora_model(), t._frozen_shapes(), {}
for name, trainable in (("lora", lora_lib.adapter_mask), ("full", None)):
    opt = lora_optimizer(t.SGD) if trainable else t.SGD
    built = build(model, opt, mesh, loss_fn=t.loss_of(model), precision=sys.argv[1], trainable=trainable)
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=NamedSharding(mesh, P(("data", "fsdp"))))
    with jax.default_device(devs[0]):
        hlo = built.train_step.lower(built.abstract_state, batch).compile().as_text()
    gemms = [o for o in op_inventory(hlo) if o["kind"] == "gemm"]
    out[name] = {"gemms": [[o["batch"], o["m"], o["n"], o["k"]] for o in gemms],
                 "collectives": weight_shaped_results(hlo, shapes)}
print(json.dumps(out))
"""


@pytest.mark.slow
@pytest.mark.parametrize("precision", ["params=float32,compute=bfloat16"])
def test_no_gradient_of_a_frozen_weights_shape_in_the_h100_compiled_backward(precision):
    """The same check on the program XLA:GPU compiles for 8 x H100 (deviceless), where matmuls
    are GEMM fusions and cuBLAS calls the CPU regex does not see: no GEMM of the LoRA step
    computes a frozen weight's gradient, no collective has a frozen weight's shape; the step
    training everything computes them."""
    import os

    from fsdp_jax.targets import gpu as targets
    from helpers import json_child

    assert targets.plugin_installed(), "CUDA plugin missing: python -m fsdp_jax.targets install cuda"
    found = json_child(_H100_CHILD, precision, env=targets.child_env(dict(os.environ)))
    # a weight gradient contracts over the device's token rows (1 x 16 here: k = 16, batch 1);
    # XLA:GPU merges sibling GEMMs (a base weight's gradient with its adapter's: 40 x 44), so
    # the test reads widths, not exact shapes: an adapter's is at most 3 ranks wide (12), a
    # frozen weight's at least its narrowest dim (kv 2 x 10 = 20)
    narrowest = min(CFG.n_kv_heads * CFG.head_dim, CFG.d_model, CFG.ffn_dim)
    assert 3 * SPEC.rank < narrowest

    def weight_grads(gemms):
        return [g for g in gemms if g[0] == 1 and g[3] == 16 and min(g[1], g[2]) >= narrowest]

    assert weight_grads(found["lora"]["gemms"]) == [] and found["lora"]["collectives"] == [], found["lora"]
    assert len(weight_grads(found["full"]["gemms"])) >= 5, found["full"]  # the same step training everything


_REFERENCE: list = []


def _parity_reference():
    """The LoRA model, its loss, its start (B drawn; a host copy, which each strategy places: its step
    donates what it is given), 3 batches and the adapters trained on one device by `jax.grad` over the
    adapters alone: once per module, for every strategy. Returns (model, loss_fn, p0, base, data,
    ref_ad, ref_losses)."""
    if not _REFERENCE:
        model = lora_model()
        loss_fn = loss_of(model)
        p0 = nonzero_b(jax.jit(model.init)(jax.random.key(0)))
        base, ad0 = lora_lib.split(p0)
        data = batches(3)
        ref_ad, ref_losses = reference_train(lambda a, b: loss_fn(lora_lib.join(base, a), b), SGD, ad0, data)
        _REFERENCE.append((model, loss_fn, jax.device_get(p0), base, data, ref_ad, ref_losses))
    return _REFERENCE[0]


STRATEGIES = [
    ("full_shard", (1, 8, 1)),
    ("shard_grad_op", (1, 8, 1)),
    ("shard_opt", (1, 8, 1)),
    ("no_shard", (8, 1, 1)),
    ("hybrid_shard", (2, 4, 1)),
    ("full_shard", (1, 4, 2)),
]


@pytest.mark.parametrize("strategy,mesh", STRATEGIES, ids=[f"{s}-{'x'.join(map(str, m))}" for s, m in STRATEGIES])
@pytest.mark.fast_cases("full_shard-1x8x1")
def test_lora_parity_with_one_device_under_every_strategy(strategy, mesh):
    """The adapters trained on 8 devices equal the adapters trained on one device by plain
    `jax.grad` of the loss with respect to the adapters alone (the base a constant)."""
    model, loss_fn, p0, base, data, ref_ad, ref_losses = _parity_reference()
    built = build(
        model,
        lora_optimizer(SGD),
        make_mesh(*mesh),
        strategy,
        loss_fn=loss_fn,
        trainable=lora_lib.adapter_mask,
        max_replicated_fraction=None,
        min_shard_size=0,
    )
    state = built.place(p0)
    losses = []
    for b in data:
        state, metrics = built.train_step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    got_base, got_ad = lora_lib.split(state.params)
    assert max_abs_diff(got_ad, ref_ad) < 1e-6
    assert max_abs_diff(got_base, base) == 0.0


BAD_LORA = [
    (["lora.rank=21"], "lora.rank", "must be <= 20"),  # wk and wv: 2 kv heads x 10 wide
    (["lora.rank=0", "lora.init_from=peft:x"], "lora.init_from", "needs lora.rank > 0"),
    (["lora.rank=4", "lora.alpha=0"], "lora.alpha", "must be > 0"),
    (["lora.rank=4", "lora.targets=q_proj,lm_head"], "lora.targets", "lm_head matches no weight"),
    (["lora.rank=4", "lora.targets=,"], "lora.targets", "all-linear, q_proj k_proj"),
    (["lora.rank=4", "lora.dropout=1"], "lora.dropout", "must be in [0, 1)"),
    (["lora.rank=4", "lora.dropout=-0.5"], "lora.dropout", "must be in [0, 1)"),
    (["lora.rank=4", "lora.init_from=adapters/"], "lora.init_from", "peft:DIR"),
    (["lora.rnak=4"], "lora.rnak", "lora.rank"),  # did you mean
]


@pytest.mark.parametrize("overrides,key,words", BAD_LORA)
def test_bad_lora_config_is_one_line_naming_the_key(overrides, key, words):
    from fsdp_jax.app.config import load_config, validate
    from fsdp_jax.errors import ConfigError

    model = [f"model.{k}={getattr(CFG, k)}" for k in ("vocab_size", "d_model", "n_heads", "n_kv_heads", "ffn_dim")]
    with pytest.raises(ConfigError) as e:
        validate(load_config("configs/tiny.yaml", model + ["model.max_seq_len=16", "data.seq_len=16", *overrides]))
    msg = str(e.value)
    assert "\n" not in msg and key in msg and words in msg, msg


def test_lora_flops_count_four_per_frozen_param_and_six_per_adapter_param():
    from fsdp_jax.app.models.decoder import count_params, flops_per_token

    cfg = DecoderConfig(vocab_size=96, d_model=40, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=56, max_seq_len=16)
    matmul = count_params(cfg) - cfg.vocab_size * cfg.d_model
    attention = flops_per_token(cfg, 16) - 6 * matmul
    adapters = lora_lib.adapter_param_count(cfg, SPEC)
    params = lora_model().abstract_params
    assert adapters == sum(x.size for x in jax.tree.leaves(lora_lib.split(params)[1]))
    assert flops_per_token(cfg, 16, SPEC) == 4 * matmul + 6 * adapters + attention


def test_precision_frozen_dtype_parses_and_prints_and_defaults_to_compute():
    from fsdp_jax.sharding.precision import Policy

    p = Policy.parse("params=float32,compute=float32,frozen=bf16")
    assert p.frozen_storage_dtype == jnp.bfloat16 and Policy.parse(str(p)) == p
    q = Policy.parse("params=float32,compute=bfloat16")
    assert q.frozen_dtype is None and q.frozen_storage_dtype == jnp.bfloat16 and "frozen" not in str(q)


def test_base_checksum_is_the_same_on_every_mesh_and_sees_one_changed_bit():
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fsdp_jax.app.trainer.lora_state import checksum

    base, _ = lora_lib.split(jax.jit(lora_model().init)(jax.random.key(0)))
    one = checksum(base)
    mesh = make_mesh(1, 8, 1)
    sharded = jax.tree.map(
        lambda x: jax.device_put(
            x, NamedSharding(mesh, P(*([None] * (x.ndim - 1)), "fsdp" if x.shape[-1] % 8 == 0 else None))
        ),
        base,
    )
    assert checksum(sharded) == one
    flipped = jax.tree.map(lambda x: x, base)
    w = np.asarray(flipped["blocks"]["mlp"]["w_up"]).copy()
    w.view(np.uint32)[0, 3, 5] ^= 1  # one bit of one weight
    flipped["blocks"]["mlp"]["w_up"] = jnp.asarray(w)
    assert checksum(flipped) != one
