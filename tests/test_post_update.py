"""The train step's `post_update` (`fsdp_jax.train.make_train_step`): a rule moving params by the
step's aux after the update (DeepSeek-V3's bias rule uses it), over microbatches and 8 devices,
undone with a skipped step; refused without aux."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from fsdp_jax.model.fns import adapt_model
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.train.build import build


def loss_fn(p, batch):  # batch (B, 8)
    y = batch @ p["w"]  # (B, 8)
    return jnp.mean(y**2), {"colsum": jnp.sum(jnp.abs(y), axis=0)}


def rule(p, aux):  # aux leaves (microbatches, 8): the step's sums
    return {**p, "seen": p["seen"] + aux["colsum"].reshape(-1, 8).sum(0)}


def test_post_update_moves_params_by_the_whole_steps_aux_and_is_skipped_with_the_step():
    fns, values, _ = adapt_model({"w": jnp.ones((8, 8)), "seen": jnp.zeros((8,))}, None)
    built = build(
        fns,
        optax.sgd(0.0),
        make_mesh(1, 8, 1),
        "full_shard",
        loss_fn=loss_fn,
        has_aux=True,
        min_shard_size=0,
        microbatches=2,
        post_update=rule,
    )
    state = built.state_from_params(values)
    batch = jax.random.normal(jax.random.key(0), (16, 8))
    state, metrics = built.train_step(state, batch)
    seen = np.asarray(state.params["seen"])
    np.testing.assert_allclose(seen, np.abs(np.asarray(batch) @ np.ones((8, 8))).sum(0), rtol=1e-5)
    state, metrics = built.train_step(state, batch.at[0, 0].set(jnp.nan))
    assert int(metrics["skipped"]) == 1 and np.array_equal(np.asarray(state.params["seen"]), seen)
    with pytest.raises(ValueError, match="post_update needs has_aux"):
        build(fns, optax.sgd(0.0), make_mesh(1, 8, 1), "full_shard", loss_fn=loss_fn, post_update=rule)
