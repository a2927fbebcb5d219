"""`verify` on mixture-of-experts models compares the trainer's objective: cross-entropy plus
`router_aux_loss_coef` x aux + `router_z_loss_coef` x z, as the trainer's step computes it,
under every strategy; a router term that differs between the one-device run and a sharded
one is caught; a published MoE config is shrunk keeping its expert dims' divisibility."""

from __future__ import annotations

import json

import jax
import numpy as np
import optax
import pytest

from fsdp_jax.app.models import moe as moe_lib
from fsdp_jax.app.models.llama import cross_entropy
from fsdp_jax.app.trainer.build import build_from_config, make_loss_fn, trainer_model
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.app.verify_batches import verify_batches
from fsdp_jax.app.verify_shrink import shrunk_model
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.verify.run import verify
from helpers import TINY_MODEL_OVERRIDES, call

MOE_OVERRIDES = [
    *TINY_MODEL_OVERRIDES,
    "model.n_experts=4",
    "model.experts_per_token=2",
    "model.moe_ffn_dim=64",
    "model.router_aux_loss_coef=0.1",
    "model.router_z_loss_coef=0.01",
    "data.source=none",
]


def _cfg(*more):
    return load_run_config("configs/tiny.yaml", [*MOE_OVERRIDES, *more])


def test_verify_passes_on_a_moe_config_with_the_trainers_objective(capsys):
    """Every strategy passes; verify's reference loss at step 1 is the trainer's step loss
    on the same params and batch (so it holds the router terms), and that differs from the
    bare cross-entropy by exactly coef x aux + z_coef x z."""
    rc, out, err = call(
        "verify", "--config", "configs/tiny.yaml", "--steps", "2", "--json", *MOE_OVERRIDES, capsys=capsys
    )
    assert rc == 0, err[-3000:] + out
    doc = json.loads(out)
    assert doc["passed"] and len(doc["strategies"]) == 5

    cfg = _cfg()
    batch = verify_batches(cfg, 1, 0)[0][0]
    model = trainer_model(cfg.model, cfg.remat)
    one = make_mesh(1, 1, 1, devices=jax.devices()[:1])
    built = build_from_config(cfg, model, optax.sgd(0.0), one, "no_shard", max_replicated_fraction=None)
    state = built.init_state(jax.random.key(0))  # verify's init: seed 0
    params = jax.device_get(state.params)
    _, metrics = built.train_step(state, batch)
    trainer_loss = float(metrics["loss"])
    assert abs(doc["reference_loss"][0] / trainer_loss - 1) < 1e-6, (doc["reference_loss"], trainer_loss)

    logits, stats = model.apply(params, batch[:, :-1], router=True)
    ce = float(cross_entropy(logits, batch[:, 1:]))
    terms = 0.1 * float(moe_lib.aux_loss(stats)) + 0.01 * float(moe_lib.z_loss(stats))
    assert terms > 1e-3 * ce  # far above verify's tolerance: a verify without them would differ
    assert abs(trainer_loss - (ce + terms)) < 1e-5 * trainer_loss


def test_verify_catches_a_router_term_that_differs_on_the_sharded_side():
    """A loss whose aux coefficient is doubled whenever the step's mesh has more than one
    device: the one-device reference and every sharded run then optimise different
    objectives, and verify fails them at step 1 on the loss."""
    cfg = _cfg()
    model = trainer_model(cfg.model)
    good = make_loss_fn(model, cfg.model)

    def wrong(params, batch):
        loss, aux = good(params, batch)
        if jax.sharding.get_abstract_mesh().size > 1:  # traced under the step's mesh
            loss = loss + cfg.model.router_aux_loss_coef * aux["router_aux_loss"]
        return loss, aux

    batches = verify_batches(cfg, 2, 0)[0]
    kw = dict(batches=batches, strategies=["full_shard", "no_shard"], steps=2, has_aux=True, check_init=False)
    report = verify(model, optax.adamw(1e-3), wrong, **kw)
    assert not report.passed
    for s in report.strategies.values():
        assert not s.passed and s.first_divergence.step == 1 and s.first_divergence.loss is not None
    assert verify(model, optax.adamw(1e-3), good, **kw).passed  # the same run with one objective passes


def test_shrunk_moe_config_keeps_the_expert_dims_divisibility():
    """Mixtral-8x7B and Qwen3-30B-A3B shrink for verify: experts and the expert FFN shrink with
    the same gcd with the device count, top-k fits, the published top-k stays."""
    for name in ("mixtral_8x7b", "qwen3_30b_a3b"):
        m = load_run_config(f"configs/{name}.yaml").model
        new, changed = shrunk_model(m, 8)
        assert new.n_experts <= max(8, m.experts_per_token) * 2 and new.experts_per_token == m.experts_per_token
        assert new.experts_per_token <= new.n_experts
        for k in ("n_experts", "moe_ffn_dim"):
            assert np.gcd(getattr(new, k), 8) == np.gcd(getattr(m, k), 8), k
        assert new.moe_ffn_dim < m.moe_ffn_dim and "model.moe_ffn_dim" in changed


@pytest.mark.slow
def test_cli_verifies_mixtral_shrunk(capsys):
    rc, out, err = call(
        "verify", "--config", "configs/mixtral_8x7b.yaml", "--strategies", "full_shard", "--steps", "1", "--json",
        "data.source=none", capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err[-3000:] + out
    doc = json.loads(out)
    assert doc["passed"] and doc["shrunk"]["model.moe_ffn_dim"][0] == 14336
