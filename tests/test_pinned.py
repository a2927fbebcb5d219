"""Behaviour no test pinned before issue #28: each test here fails when the behaviour
it names is changed (the mutation is in its docstring; each was applied and seen to fail).
"""

import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_jax as fj
from fsdp_jax import checkpoint as ck
from fsdp_jax.sharding import rules as rl
from helpers import max_abs_diff, reference_train, tiny_llama, token_batches

ROOT = Path(__file__).resolve().parents[1]


# -- the non-finite guard looks at the grad norm too ------------------------------------------------


def _grad_times(factor: float):
    """Identity whose gradient is multiplied by `factor` (inf, nan): a finite loss with a
    non-finite gradient, as an overflow in the backward pass alone gives."""

    @jax.custom_vjp
    def f(x):
        return x

    def fwd(x):
        return x, None

    def bwd(_, g):
        return (g * factor,)

    f.defvjp(fwd, bwd)
    return f


@pytest.mark.parametrize("factor", [np.inf, np.nan])
def test_a_finite_loss_with_a_nonfinite_grad_norm_is_skipped(factor):
    """Mutation: `ok = jnp.isfinite(loss)` (the grad norm not looked at) -> the step
    applies inf/NaN updates and this fails."""
    mesh = fj.make_mesh(fsdp=8)
    params = {"w": jnp.ones((64, 32), jnp.float32)}
    opt = optax.sgd(0.1)
    state, plan = fj.init_train_state(
        lambda r: params, opt, mesh, jax.random.key(0), logical_axes={"w": ("embed", "mlp")}, min_shard_size=1
    )
    blowup = _grad_times(factor)

    def loss_fn(p, x):
        return jnp.mean((x @ blowup(p["w"])) ** 2)

    step = fj.make_train_step(loss_fn, opt, plan, donate=False)
    x = jnp.ones((16, 64), jnp.float32)
    new, m = step(state, x)
    assert np.isfinite(float(m["loss"])) and not np.isfinite(float(m["grad_norm"]))
    assert int(m["skipped"]) == 1 and int(new.step) == 0
    np.testing.assert_array_equal(np.asarray(new.params["w"]), np.asarray(state.params["w"]))
    ok_step = fj.make_train_step(lambda p, x: jnp.mean((x @ p["w"]) ** 2), opt, plan, donate=False)
    new, m = ok_step(state, x)
    assert int(m["skipped"]) == 0 and int(new.step) == 1


# -- optimizer state shaped unlike its param, large enough to shard --------------------------------


def test_adafactor_factored_state_above_the_threshold_is_sharded_and_trains_like_one_device():
    """Adafactor keeps a (rows,) and a (cols,) second moment for a (rows, cols) param:
    no param spec fits them, so the fallback rule shards them. Above min_shard_size they
    must shard over fsdp, and the step must match one device. Mutation: the fallback for
    state of another shape returning replicated (P()) -> the spec assertion fails; the
    param's spec instead -> the plan raises (a 2-D spec on a 1-D leaf)."""
    mesh = fj.make_mesh(fsdp=8)
    opt = optax.adafactor(1e-2, min_dim_size_to_factor=128)
    params = {"w": jax.random.normal(jax.random.key(1), (256, 512), jnp.float32) * 0.05}
    axes_ = {"w": ("embed", "mlp")}
    state, plan = fj.init_train_state(
        lambda r: params, opt, mesh, jax.random.key(0), logical_axes=axes_, min_shard_size=256
    )
    leaves = jax.tree_util.tree_flatten_with_path(jax.eval_shape(opt.init, params))[0]
    factored = {}
    for (path, leaf), sh in zip(leaves, jax.tree.leaves(plan.opt_state)):
        if getattr(leaf, "shape", ()) in ((256,), (512,)):
            factored[jax.tree_util.keystr(path)] = (leaf.shape, sh.spec)
    assert len(factored) >= 2 and all(spec == P("fsdp") for _, spec in factored.values()), factored
    for x, sh in zip(jax.tree.leaves(state.opt_state), jax.tree.leaves(plan.opt_state)):
        if x.shape in ((256,), (512,)):
            assert x.sharding.is_equivalent_to(sh, x.ndim) and x.addressable_shards[0].data.shape[0] * 8 == x.shape[0]

    def loss_fn(p, xb):
        return jnp.mean(jnp.tanh(xb @ p["w"]) ** 2)

    rng = np.random.default_rng(0)
    batches = [jnp.asarray(rng.normal(size=(16, 256)), jnp.float32) for _ in range(3)]
    step = fj.make_train_step(loss_fn, opt, plan)
    for b in batches:
        state, _ = step(state, b)
    ref, _ = reference_train(loss_fn, opt, params, batches)
    assert max_abs_diff(state.params, ref) < 1e-6


# -- eval step and sampler compute in the compute dtype ---------------------------------------------


def test_eval_step_computes_in_the_compute_dtype():
    """Mutation: make_eval_step without `policy.cast_to_compute` -> the loss sees f32 params."""
    m, loss_fn = tiny_llama()
    mesh = fj.make_mesh(fsdp=8)
    state, plan = fj.init_train_state(m.init, optax.sgd(0.1), mesh, jax.random.key(0), logical_axes=m.logical_axes)
    seen = []

    def recording_loss(params, tokens):
        seen.extend({x.dtype for x in jax.tree.leaves(params)})
        return loss_fn(params, tokens)

    batch = token_batches(1)[0]
    bf16 = fj.make_eval_step(recording_loss, plan, precision="params=float32,compute=bfloat16")
    loss16 = float(bf16(state.params, batch)["loss"])
    assert set(seen) == {jnp.dtype(jnp.bfloat16)}, seen
    seen.clear()
    loss32 = float(fj.make_eval_step(recording_loss, plan)(state.params, batch)["loss"])
    assert set(seen) == {jnp.dtype(jnp.float32)}
    assert loss16 != loss32 and abs(loss16 - loss32) < 0.05 * abs(loss32)


@pytest.mark.slow
def test_sampler_computes_in_the_compute_dtype(corpus, tmp_path):
    """Mutation: sample_text applying the model to `p` instead of
    `policy.cast_to_compute(p)` -> the forward sees f32 params."""
    import dataclasses

    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.trainer.metrics import sample_text
    from helpers import TINY_RUN_OVERRIDES

    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        TINY_RUN_OVERRIDES
        + [
            f"data.path={corpus}",
            f"run_dir={tmp_path / 'run'}",
            "train.sample_tokens=2",
            "precision=params=float32,compute=bfloat16",
        ],
    )
    m, _ = tiny_llama()
    state, plan = fj.init_train_state(
        m.init, optax.sgd(0.1), fj.make_mesh(fsdp=8), jax.random.key(0), logical_axes=m.logical_axes
    )
    seen = []

    def apply(params, tokens):
        seen.extend({x.dtype for x in jax.tree.leaves(params)})
        return m.apply(params, tokens)

    text = sample_text(dataclasses.replace(m, apply=apply), plan, cfg, state.params, None, jax.random.key(0))
    assert isinstance(text, str) and "\u2016" in text
    assert set(seen) == {jnp.dtype(jnp.bfloat16)}, seen


# -- the fallback rule: the largest divisible dim, and the threshold's boundary ---------------------


def test_fallback_takes_the_largest_divisible_dim_of_several():
    """Mutation: the first divisible dim (or the last) -> one of these fails."""
    mesh = fj.make_mesh(fsdp=8)
    cases = {
        (24, 64): P(None, "fsdp"),
        (64, 24): P("fsdp", None),
        (16, 40, 8): P(None, "fsdp", None),
        (8, 8, 24): P(None, None, "fsdp"),
        (48, 48): P("fsdp", None),  # a tie: the first
        (12, 64, 10): P(None, "fsdp", None),
    }
    for shape, want in cases.items():
        spec, notes = rl.decide_leaf(shape, None, mesh, min_shard_size=1)
        assert spec == want, (shape, spec)
        assert notes[-1].kind == rl.Why.FALLBACK and notes[-1].dim == list(want).index("fsdp")


def test_replicate_threshold_boundary_is_exact():
    """A leaf of exactly min_shard_size elements shards; one element fewer stays
    replicated. Mutation: `size <= min_shard_size` (or `<` off by one the other way)."""
    mesh = fj.make_mesh(fsdp=8)
    for limit in (256, 4096):
        at, _ = rl.decide_leaf((limit // 8, 8), None, mesh, min_shard_size=limit)
        below, notes = rl.decide_leaf((limit // 8, 8), None, mesh, min_shard_size=limit + 1)
        assert at == P("fsdp", None) and below == P(None, None), (limit, at, below)
        assert notes[-1].kind == rl.Why.THRESHOLD and notes[-1].size == limit
        # the same through a plan: a leaf at the limit is sharded, and annotated leaves too
        plan = fj.make_plan(
            {"a": jax.ShapeDtypeStruct((limit // 8, 8), jnp.float32)},
            optax.sgd(0.1),
            mesh,
            min_shard_size=limit,
            max_replicated_fraction=None,
        )
        assert plan.params["a"].spec == P("fsdp", None)


# -- CRC checks on the restore and export paths -----------------------------------------------------


def _two_steps(d: Path):
    states = {s: {"params": {"w": jnp.full((64, 256), float(s)), "b": jnp.arange(256.0) * s}} for s in (1, 2)}
    with ck.Checkpointer(d, keep=None, async_save=False) as c:
        for s, st in states.items():
            c.save(s, st)
    return states


def _flip_one_bit(step_dir: Path) -> None:
    big = max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)
    blob = bytearray(big.read_bytes())
    blob[len(blob) // 2] ^= 0x04
    big.write_bytes(bytes(blob))


def test_crc_is_checked_when_params_are_restored_and_exported(tmp_path, capsys):
    """A bit flipped in the newest step (sizes kept): `restore_params` (init_from a run)
    and `export_safetensors` (scripts/export.py) fall back to the previous step, naming
    the damage; asked for that step, they refuse it. Mutation: either path skipping
    `check_files` -> it reads step 2's bytes."""
    d = tmp_path / "ckpts"
    states = _two_steps(d)
    _flip_one_bit(d / "2")
    c = ck.Checkpointer(d, read_only=True)
    target = {"w": jax.ShapeDtypeStruct((64, 256), jnp.float32), "b": jax.ShapeDtypeStruct((256,), jnp.float32)}
    params, step, warnings = c.restore_params(target)
    assert step == 1 and "step 2" in warnings[0] and "changed since it was saved" in warnings[0]
    np.testing.assert_array_equal(np.asarray(params["w"]), np.asarray(states[1]["params"]["w"]))
    with pytest.raises(ck.CheckpointError, match="step 2: .*changed since it was saved"):
        c.restore_params(target, step=2)
    capsys.readouterr()
    info = ck.export_safetensors(d, tmp_path / "m.safetensors")
    assert info["step"] == 1 and "changed since it was saved" in capsys.readouterr().out
    exported = ck.load_safetensors(tmp_path / "m.safetensors", target)
    np.testing.assert_array_equal(np.asarray(exported["b"]), np.asarray(states[1]["params"]["b"]))
    with pytest.raises(ck.CheckpointError, match="step 2: .*changed since it was saved"):
        ck.export_safetensors(d, tmp_path / "m2.safetensors", step=2)
    assert not (tmp_path / "m2.safetensors").exists()


# -- verify's tolerances, against differences that sit near them -----------------------------------


def _scaled_by_shard_count(eps: float):
    """(model, loss_fn): the Linen MLP of test_verify whose loss is multiplied by
    1 + eps * (k - 1), k the number of batch shards (1 on one device, 8 on 8): a bug whose
    relative loss and grad-norm differences are 7 * eps, as small as we choose."""
    from test_verify import linen_setup, per_shard

    model, loss_fn = linen_setup()

    def scaled(params, b):
        k = per_shard(lambda xl: jax.lax.psum(jnp.ones((), jnp.float32), ("data", "fsdp")), out_specs=P())(b["x"])
        return loss_fn(params, b) * (1.0 + eps * (k - 1.0))

    return model, scaled


@pytest.mark.slow
def test_verify_tolerances_sit_between_a_near_healthy_and_a_near_broken_model():
    """sgd-f32 limits loss 2e-6 and grad norm 2e-6 (relative). A sharding-dependent
    difference of 0.25x the limit passes, 2.5x fails at step 1 naming loss and grad norm.
    Mutation: every tolerance loosened 10x or more -> the broken one passes; tightened 4x or
    more -> the healthy one fails."""
    from test_verify import run

    # the differences are fixed numbers (not derived from the tolerance under test)
    near_ok = run(*_scaled_by_shard_count(5e-7 / 7), strategies=("full_shard",))
    assert near_ok.passed, near_ok.format()
    s = near_ok.strategies["full_shard"]
    assert 2e-7 < s.max_loss_rel_diff < 1e-6, s.loss_rel_diff  # the bug's 5e-7, plus rounding
    near_bad = run(*_scaled_by_shard_count(5e-6 / 7), strategies=("full_shard",))
    assert not near_bad.passed
    d = near_bad.strategies["full_shard"].first_divergence
    assert d.step == 1 and d.loss is not None and d.grad_norm is not None
    assert 4e-6 < d.loss < 6e-6, d.loss


# -- the other presets: adaptive-f32, sgd-bf16, adaptive-bf16 ---------------------------------------


def _grad_scaled_by_shard_count(eps: float):
    """(model, loss_fn): the same MLP whose loss value is exact but whose gradient is
    multiplied by 1 + eps * (k - 1) (k batch shards): a grad-norm difference of 7 * eps
    with none in the loss (as a backward-only reduction bug gives)."""
    from test_verify import linen_setup, per_shard

    model, loss_fn = linen_setup()

    @jax.custom_vjp
    def scale_grad(loss, s):
        return loss

    def fwd(loss, s):
        return loss, s

    def bwd(s, g):
        return g * s, jnp.zeros_like(s)

    scale_grad.defvjp(fwd, bwd)

    def scaled(params, b):
        k = per_shard(lambda xl: jax.lax.psum(jnp.ones((), jnp.float32), ("data", "fsdp")), out_specs=P())(b["x"])
        return scale_grad(loss_fn(params, b).astype(jnp.float32), 1.0 + eps * (k - 1.0))

    return model, scaled


def _loss_scaled_in_f32(eps: float):
    """_scaled_by_shard_count with the scaling done in float32 (a bf16 loss would round
    1 + 5e-4 to 1)."""
    from test_verify import linen_setup, per_shard

    model, loss_fn = linen_setup()

    def scaled(params, b):
        k = per_shard(lambda xl: jax.lax.psum(jnp.ones((), jnp.float32), ("data", "fsdp")), out_specs=P())(b["x"])
        return loss_fn(params, b).astype(jnp.float32) * (1.0 + eps * (k - 1.0))

    return model, scaled


BF16 = "params=float32,compute=bfloat16"
# preset -> (optimizer, precision, {metric: (a difference that must pass, one that must fail)});
# fixed numbers, 0.25x and 2.5x today's limits (not derived from the tolerance under test)
PRESET_PINS = {
    "adaptive-f32": (lambda: optax.adamw(3e-3), None, {"loss": (2.5e-6, 2.5e-5), "grad_norm": (2.5e-6, 2.5e-5)}),
    "sgd-bf16": (lambda: optax.sgd(0.1, momentum=0.9), BF16, {"loss": (5e-4, 5e-3), "grad_norm": (5e-4, 5e-3)}),
    "adaptive-bf16": (lambda: optax.adamw(3e-3), BF16, {"loss": (5e-4, 5e-3), "grad_norm": (5e-3, 5e-2)}),
}


@pytest.mark.parametrize("preset", PRESET_PINS)
@pytest.mark.slow
def test_verify_presets_sit_between_a_near_healthy_and_a_near_broken_model(preset):
    """Each preset other than sgd-f32 (above), chosen by verify from the optimizer and the
    compute dtype, for its loss and its grad-norm limit separately: a sharding-dependent
    difference of 0.25x the limit passes, 2.5x fails at step 1 naming that metric (and
    only it, for the grad-only bug). Mutation: a preset's loss or grad-norm limit loosened
    10x or more -> its broken model passes; tightened 4x or more -> its healthy one fails."""
    from test_verify import run

    make_opt, precision, pins = PRESET_PINS[preset]
    bugs = {"loss": _loss_scaled_in_f32, "grad_norm": _grad_scaled_by_shard_count}
    for metric, (ok_size, bad_size) in pins.items():
        for size, should_pass in ((ok_size, True), (bad_size, False)):
            r = run(*bugs[metric](size / 7), strategies=("full_shard",), optimizer=make_opt(), precision=precision)
            assert r.tolerance.name == preset, r.tolerance
            s = r.strategies["full_shard"]
            measured = s.max_loss_rel_diff if metric == "loss" else max(s.grad_norm_rel_diff)
            # the bug's size, plus the healthy rounding noise (bf16: up to ~2e-4)
            noise = 3e-4 if precision else 2e-7
            assert 0.5 * size - noise < measured < 1.5 * size + noise, (metric, size, measured)
            assert r.passed == should_pass, (metric, size, r.format())
            if not should_pass:
                d = s.first_divergence
                assert d.step == 1, d
                assert (d.loss if metric == "loss" else d.grad_norm) is not None, d
                if metric == "grad_norm":
                    assert d.loss is None, d


def test_every_preset_limit_sits_5_to_100x_above_what_healthy_models_measure():
    """benchmarks/verify_tolerances.json holds the largest difference each healthy model
    (the reference decoder, the Linen and NNX MLPs; SGD and AdamW; f32 and bf16 compute;
    every strategy, 5 steps) showed against one device, measured by verify itself:
    regenerate it with `PYTHONPATH=$PWD JAX_PLATFORMS=cpu python
    benchmarks/verify_tolerances.py --steps 5`. Every limit of every preset, param_rtol
    included, must leave healthy models 5x room and be no more than 100x their noise.
    Mutation: any limit loosened 1000x (or tightened 4x where the margin is under 20)."""
    rows = json.loads((ROOT / "benchmarks" / "verify_tolerances.json").read_text())
    from fsdp_jax.verify.report import TOLERANCES

    kinds = {"sgd": "sgd", "adamw": "adaptive"}
    seen = set()
    for name, tol in TOLERANCES.items():
        kind, width = name.split("-")
        mine = [r for r in rows if kinds[r["optimizer"]] == kind and r["compute"] == width]
        assert len(mine) == 3, (name, mine)  # the three models
        for field, column in (
            ("loss_rtol", "loss_rel"),
            ("grad_norm_rtol", "grad_norm_rel"),
            ("param_rtol", "param_rel"),
        ):
            healthy = max(r[column] for r in mine)
            limit = getattr(tol, field)
            assert 5 * healthy <= limit <= 100 * healthy, (name, field, limit, healthy)
            seen.add((name, field))
    assert len(seen) == 12
