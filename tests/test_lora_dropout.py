"""LoRA dropout (PEFT's `lora_dropout`): y = x W + scale * (dropout(x) A) B in training only.

Pinned: without a key (eval, verify, logits) or at rate 0 the decoder computes exactly what it
did without dropout; with a key, the loss and adapter grads equal a by-hand decoder written
here that draws the same masks from the same key; the trained adapters on 8 devices equal
one device's under dropout; each step draws other masks; an interrupted run with dropout
resumes bit for bit; the PEFT export writes the rate; bad rates are one line, exit 2."""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from test_lora import CFG, nonzero_b

from fsdp_jax.app.hf import peft
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.trainer.build import lora_optimizer, make_loss_fn, trainer_model
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build
from helpers import max_abs_diff, token_batches

RATE = 0.3
SPEC = lora_lib.LoraSpec(rank=4, alpha=8.0, dropout=RATE)
SGD = optax.sgd(0.05, momentum=0.9)
GOLDEN = Path(__file__).parent / "golden"


def batches(n=3):
    return token_batches(n, batch=8, seq=16, vocab=CFG.vocab_size)


def _rms(x, w, eps):
    return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps) * w


def _rope(x, theta):  # (B, S, H, Dh), rotate-half
    s, dh = x.shape[1], x.shape[-1]
    ang = jnp.arange(s, dtype=jnp.float32)[:, None] * theta ** (-jnp.arange(0, dh // 2, dtype=jnp.float32) * 2 / dh)
    cos, sin = jnp.cos(ang)[None, :, None], jnp.sin(ang)[None, :, None]
    x1, x2 = x[..., : dh // 2], x[..., dh // 2 :]
    return jnp.concatenate([x1 * cos - x2 * sin, x1 * sin + x2 * cos], axis=-1)


def by_hand_logits(params, tokens, key, rate, cfg=CFG, spec=SPEC):
    """The Llama-2 decoder with adapters, written out layer by layer from the params tree; the
    adapter input of weight w in layer l is dropped with the mask
    bernoulli(fold_in(fold_in(key, l), WEIGHTS.index(w)), 1 - rate) over its (rows, in) shape."""
    b, s = tokens.shape
    d, h, kvh, dh, r = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, spec.rank
    x = params["embed"][tokens]
    for layer in range(cfg.n_layers):
        lp = jax.tree.map(lambda a: a[layer], params["blocks"])

        def lin(module, name, rows, w):
            ad = lp[module]["lora"][name]
            kept = rows
            if key is not None:
                k = jax.random.fold_in(jax.random.fold_in(key, layer), lora_lib.WEIGHTS.index(name))
                mask = jax.random.bernoulli(k, 1.0 - rate, rows.shape)
                kept = jnp.where(mask, rows / (1.0 - rate), 0.0)
            a, bb = ad["lora_a"].reshape(-1, r), ad["lora_b"].reshape(r, -1)
            return rows @ w.reshape(rows.shape[1], -1) + spec.scale * ((kept @ a) @ bb)

        rows = _rms(x, lp["attn_norm"]["scale"], cfg.norm_eps).reshape(b * s, d)
        q = _rope(lin("attn", "wq", rows, lp["attn"]["wq"]).reshape(b, s, h, dh), cfg.rope_theta)
        k = _rope(lin("attn", "wk", rows, lp["attn"]["wk"]).reshape(b, s, kvh, dh), cfg.rope_theta)
        v = lin("attn", "wv", rows, lp["attn"]["wv"]).reshape(b, s, kvh, dh)
        k, v = jnp.repeat(k, h // kvh, axis=2), jnp.repeat(v, h // kvh, axis=2)  # q head n uses kv n // (H/K)
        scores = jnp.einsum("bshd,bthd->bhst", q, k) / np.sqrt(dh)
        scores = jnp.where(jnp.tril(jnp.ones((s, s), bool)), scores, -jnp.inf)
        o = jnp.einsum("bhst,bthd->bshd", jax.nn.softmax(scores, axis=-1), v).reshape(b * s, h * dh)
        x = x + lin("attn", "wo", o, lp["attn"]["wo"]).reshape(b, s, d)
        rows = _rms(x, lp["mlp_norm"]["scale"], cfg.norm_eps).reshape(b * s, d)
        hid = jax.nn.silu(lin("mlp", "w_gate", rows, lp["mlp"]["w_gate"])) * lin("mlp", "w_up", rows, lp["mlp"]["w_up"])
        x = x + lin("mlp", "w_down", hid, lp["mlp"]["w_down"]).reshape(b, s, d)
    return _rms(x, params["final_norm"]["scale"], cfg.norm_eps) @ params["head"]


def xent(logits, targets):
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def test_without_a_key_or_at_rate_zero_the_decoder_computes_what_it_did_without_dropout():
    dropping, plain = trainer_model(CFG, "none", SPEC), trainer_model(CFG, "none", lora_lib.LoraSpec(4, 8.0))
    # each model's apply one compiled program (both sides of every comparison jitted alike)
    plain_apply = jax.jit(plain.apply)
    params = nonzero_b(jax.jit(plain.init)(jax.random.key(0)))
    tokens = batches(1)[0][:, :-1]
    want = np.asarray(plain_apply(params, tokens))
    np.testing.assert_array_equal(np.asarray(jax.jit(dropping.apply)(params, tokens)), want)  # no key: no dropout
    np.testing.assert_array_equal(np.asarray(plain_apply(params, tokens, dropout_key=jax.random.key(1))), want)
    # the loss of a rate-0 config is the plain (params, batch) loss: no run key, no extended call; both
    # sides one program (apply then xent) so that neither rounds differently
    loss_fn = make_loss_fn(plain)
    plain_loss = jax.jit(lambda p, b: xent(plain.apply(p, b[:, :-1]), b[:, 1:]))
    assert float(jax.jit(loss_fn)(params, batches(1)[0])) == float(plain_loss(params, batches(1)[0]))


@pytest.mark.slow
@pytest.mark.parametrize("scan", [True, False], ids=["scanned", "unscanned"])
def test_loss_and_adapter_grads_equal_a_by_hand_decoder_with_the_same_masks(scan):
    cfg = DecoderConfig(**{**CFG.__dict__, "scan_layers": scan})
    model = trainer_model(cfg, "none", SPEC)
    # scanned layout, on the host (slicing and stacking below in NumPy, not op by op)
    scanned = jax.device_get(nonzero_b(jax.jit(trainer_model(CFG, "none", SPEC).init)(jax.random.key(0))))
    params = scanned
    if not scan:  # the same numbers in the per-layer layout
        params = {**params, "blocks": {i: jax.tree.map(lambda a: a[i], params["blocks"]) for i in range(2)}}
    # back on the device: closed over as host arrays, XLA would fold the base in as constants
    params, scanned = jax.device_put((params, scanned))
    base, ad = lora_lib.split(params)
    sbase, sad = lora_lib.split(scanned)
    tokens = batches(1)[0]
    key = jax.random.key(7)

    def ours(a, k):
        return xent(model.apply(lora_lib.join(base, a), tokens[:, :-1], dropout_key=k), tokens[:, 1:])

    def theirs(a, k):
        return xent(by_hand_logits(lora_lib.join(sbase, a), tokens[:, :-1], k, RATE), tokens[:, 1:])

    for k in (None, key):  # the reference agrees without dropout, and with the same masks
        got_l, got_g = jax.jit(jax.value_and_grad(ours))(ad, k)
        want_l, want_g = jax.jit(jax.value_and_grad(theirs))(sad, k)
        np.testing.assert_allclose(float(got_l), float(want_l), rtol=2e-6)
        got_g, want_g = jax.device_get((got_g, want_g))
        if not scan:
            got_g = {
                "blocks": {
                    m: jax.tree.map(lambda *xs: np.stack(xs), *[got_g["blocks"][i][m] for i in range(2)])
                    for m in ("attn", "mlp")
                }
            }
        scale = max(float(np.max(np.abs(g))) for g in jax.tree.leaves(want_g))
        assert max_abs_diff(got_g, want_g) < 2e-5 * scale
    no_drop = float(jax.jit(ours)(ad, None))
    assert abs(float(got_l) - no_drop) > 1e-3  # the masks act
    other = float(jax.jit(theirs)(sad, jax.random.key(8)))
    assert abs(other - float(got_l)) > 1e-4  # another key: other masks


def reference_dropout_train(loss_fn, base, adapters, data, run_key, microbatches):
    """One device, plain `jax.grad` over the adapters: step s's key `fold_in(run_key, s)`,
    microbatch j (rows j, j+k, ...) of k > 1 `fold_in(that, j)`, the mean of their losses."""

    def loss(a, batch, key):
        if microbatches == 1:
            return loss_fn(lora_lib.join(base, a), batch, rng=key)
        parts = [
            loss_fn(lora_lib.join(base, a), batch[j::microbatches], rng=jax.random.fold_in(key, j))
            for j in range(microbatches)
        ]
        return sum(parts) / microbatches

    @jax.jit
    def step(a, s, batch, key):
        value, g = jax.value_and_grad(loss)(a, batch, key)
        u, s = SGD.update(g, s, a)
        return optax.apply_updates(a, u), s, value

    dev = jax.devices()[0]
    adapters = jax.device_put(adapters, dev)
    opt, losses = SGD.init(adapters), []
    for i, batch in enumerate(data):
        adapters, opt, value = step(adapters, opt, jax.device_put(batch, dev), jax.random.fold_in(run_key, i))
        losses.append(float(value))
    return adapters, losses


PARITY = [("full_shard", (1, 8, 1), 1), ("full_shard", (1, 4, 2), 1), ("shard_opt", (1, 8, 1), 2)]
_REFERENCES: dict = {}


def _dropout_reference(micro):
    """The LoRA model with dropout, its start, 3 batches of 8 x `micro` rows, the run key and the
    one-device reference trained on them: once per microbatch count, for every mesh that uses it.
    Returns (model, loss_fn, p0, base, data, run_key, ref_ad, ref_losses)."""
    if micro not in _REFERENCES:
        model = trainer_model(CFG, "none", SPEC)
        loss_fn = make_loss_fn(model, dropout=True)
        p0 = nonzero_b(jax.jit(model.init)(jax.random.key(0)))
        base, ad0 = lora_lib.split(p0)
        data, run_key = token_batches(3, batch=8 * micro, seq=16, vocab=CFG.vocab_size), jax.random.key(5)
        ref_ad, ref_losses = reference_dropout_train(loss_fn, base, ad0, data, run_key, micro)
        _REFERENCES[micro] = (model, loss_fn, p0, base, data, run_key, ref_ad, ref_losses)
    return _REFERENCES[micro]


@pytest.mark.slow
@pytest.mark.parametrize(
    "strategy,mesh,micro", PARITY, ids=[f"{s}-{'x'.join(map(str, m))}-mb{k}" for s, m, k in PARITY]
)
def test_dropout_trains_on_8_devices_as_on_one(strategy, mesh, micro):
    model, loss_fn, p0, base, data, run_key, ref_ad, ref_losses = _dropout_reference(micro)
    built = build(
        model,
        lora_optimizer(SGD),
        make_mesh(*mesh),
        strategy,
        loss_fn=loss_fn,
        trainable=lora_lib.adapter_mask,
        rng=run_key,
        microbatches=micro,
        max_replicated_fraction=None,
        min_shard_size=0,
    )
    state, losses = built.place(p0), []
    for b in data:
        state, metrics = built.train_step(state, b)
        losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-6)
    got_base, got_ad = lora_lib.split(state.params)
    assert max_abs_diff(got_ad, ref_ad) < 1e-6
    assert max_abs_diff(got_base, base) == 0.0
    # eval has no dropout: the deterministic loss
    params = jax.device_get(state.params)
    want = float(jax.jit(lambda p, b: xent(model.apply(p, b[:, :-1]), b[:, 1:]))(params, data[0]))
    np.testing.assert_allclose(float(built.eval_step(state.params, data[0])["loss"]), want, rtol=1e-6)


@pytest.mark.parametrize("rate", [RATE, 0.0])
@pytest.mark.slow
def test_each_step_draws_other_masks_and_the_same_step_the_same(rate):
    spec = lora_lib.LoraSpec(4, 8.0, dropout=rate)
    model = trainer_model(CFG, "none", spec)
    built = build(
        model,
        lora_optimizer(SGD),
        make_mesh(1, 8, 1),
        loss_fn=make_loss_fn(model, dropout=True),
        trainable=lora_lib.adapter_mask,
        rng=jax.random.key(5),
        max_replicated_fraction=None,
    )
    state0, batch = built.place(nonzero_b(jax.jit(model.init)(jax.random.key(0)))), batches(1)[0]

    def loss_at(s: int) -> float:
        state = jax.tree.map(lambda x: x.copy(), state0)  # the step donates its input
        state = state.replace(step=jax.device_put(np.int32(s), state.step.sharding))
        return float(built.train_step(state, batch)[1]["loss"])

    losses = [loss_at(0), loss_at(1), loss_at(0), loss_at(7)]
    assert losses[0] == losses[2]
    if rate:
        assert losses[0] != losses[1] and losses[1] != losses[3]
    else:  # no dropout: the step does not matter
        assert losses[0] == losses[1] == losses[3]


@pytest.mark.parametrize("value", ["-0.1", "1.0", "1.5"])
def test_a_dropout_outside_0_1_is_one_line_exit_2(value, tmp_path, capsys):
    from helpers import TINY_MODEL_OVERRIDES, call, one_line

    over = [*TINY_MODEL_OVERRIDES, "lora.rank=4", f"lora.dropout={value}", f"run_dir={tmp_path / 'run'}"]
    rc, _, err = call("train", "--config", "configs/tiny.yaml", *over, capsys=capsys)
    line = one_line(rc, err, "lora.dropout", "[0, 1)")
    assert value in line
    assert not (tmp_path / "run").exists()


def test_peft_adapter_config_carries_the_rate_and_another_rate_is_accepted(tmp_path):
    """lora_dropout is a training hyper-parameter (the weights do not depend on it): an adapter
    trained at one rate starts a run at another; the export writes the run's rate."""
    raw = json.loads((GOLDEN / "peft" / "llama3" / "adapter_config.json").read_text())
    assert raw["lora_dropout"] == 0.0
    from fsdp_jax.app.hf import load as hf

    cfg = hf.HFCheckpoint(GOLDEN / "hf" / "llama3").config
    targets = lora_lib.resolve_targets(" ".join(raw["target_modules"]))
    spec = lora_lib.LoraSpec(raw["r"], float(raw["lora_alpha"]), targets, dropout=0.1)
    adapters = peft.read_peft(GOLDEN / "peft" / "llama3", cfg, spec)
    info = peft.write_peft(tmp_path / "out", adapters, cfg, spec)
    assert json.loads((tmp_path / "out" / "adapter_config.json").read_text())["lora_dropout"] == 0.1
    again = peft.read_peft(info["path"], cfg, lora_lib.LoraSpec(raw["r"], float(raw["lora_alpha"]), targets))
    assert max_abs_diff(again, adapters) == 0.0


@pytest.mark.slow
def test_a_run_with_dropout_resumes_bit_for_bit_and_exports_its_rate(corpus, tmp_path, capsys):
    """The trainer's LoRA run with lora.dropout: an interrupted run resumes onto the same
    masks (the step's key comes from the seed and the step alone); eval runs without dropout;
    `--peft` writes the run's lora_dropout."""
    from test_lora_trainer import config, leaves, records

    from fsdp_jax.app.trainer.loop import train
    from helpers import call

    drop = ["lora.dropout=0.25", "train.eval_every=3"]
    straight = train(config(corpus, tmp_path / "straight", *drop), progress=False)
    cfg = config(corpus, tmp_path / "resumed", *drop)
    assert train(cfg, progress=False, stop_after=3)["preempted"] == "stop_after=3"
    second = train(cfg, progress=False)
    assert second["run"].start_step == 3
    for a, b in zip(leaves(second["run"].state), leaves(straight["run"].state)):
        np.testing.assert_array_equal(a, b)
    assert records(tmp_path / "resumed") == records(tmp_path / "straight")
    plain = train(config(corpus, tmp_path / "plain", "train.eval_every=3"), progress=False, stop_after=1)
    assert plain["run"].start_step == 0
    first_drop, first_plain = records(tmp_path / "straight")[1], records(tmp_path / "plain")[1]
    assert first_drop[0] != first_plain[0]  # the same batch and adapters: dropout changed the loss
    rc, _, err = call("export", str(tmp_path / "straight"), "--peft", str(tmp_path / "adapter"), capsys=capsys)
    assert rc == 0, err
    assert json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())["lora_dropout"] == 0.25


@pytest.mark.slow
def test_verify_runs_a_dropout_config_without_dropout_and_says_so(capsys):
    from helpers import TINY_MODEL_OVERRIDES, call

    over = [*TINY_MODEL_OVERRIDES, "lora.rank=4", "lora.alpha=8", "lora.dropout=0.1"]
    args = ["--config", "configs/tiny.yaml", "--steps", "2", "--strategies", "full_shard", *over]
    rc, out, err = call("verify", *args, capsys=capsys)
    assert rc == 0, err
    assert "lora.dropout=0.1 off: verify compares the steps without dropout" in out
    assert " PASS" in out
