"""The dropout key of a train step is folded with the step (`fold_in(run key, step)`): the same
params, model state and batch at step 0 and at step 1 give different train losses, and the
same step twice gives the same loss. (test_stateful_models varies only the run key, so a step
that dropped the fold survived it.)"""

import jax
import numpy as np
from test_stateful_models import SGD, mesh_for, nnx_loss, nnx_model, vector_batches

from fsdp_jax.train.shard_model import shard_model


def test_same_params_and_batch_at_steps_0_and_1_draw_other_dropout_masks():
    model = nnx_model()
    loss_fn = nnx_loss(model)
    sm = shard_model(
        model, SGD, mesh_for("full_shard"), "full_shard", rng=jax.random.key(0), max_replicated_fraction=None
    )
    batch = vector_batches(1)[0]
    step = sm.train_step(loss_fn, rng=jax.random.key(1))

    def loss_at(s: int) -> float:
        state = jax.tree.map(lambda x: x.copy(), sm.state)  # the step donates its input
        state = state.replace(step=jax.device_put(np.int32(s), state.step.sharding))
        return float(step(state, batch)[1]["loss"])

    losses = [loss_at(0), loss_at(1), loss_at(0), loss_at(7)]
    assert losses[0] == losses[2]  # the same step: the same masks
    assert losses[0] != losses[1] and losses[1] != losses[3]  # another step: other masks
