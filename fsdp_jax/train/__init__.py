"""Training: the one road from a model to sharded state and jitted steps.

build         model + optimizer + mesh + strategy -> plan once -> sharded state + steps
shard_model   the one-call drop-in API over `build` (`shard_model`, `ShardedModel`)
state         the train state, abstract shapes and sharded initialisation
step          the jitted train and eval steps, over step_parts (their composable parts)
trainable     frozen params: which leaves the step differentiates
layer_gather  explicit per-layer parameter gathers
"""

from fsdp_jax.train.build import Built, build, init_train_state
from fsdp_jax.train.shard_model import ShardedModel, shard_model
from fsdp_jax.train.state import TrainState, abstract_state, shard_params, state_shardings
from fsdp_jax.train.step import CompiledStep, make_eval_step, make_train_step, sharding_context
from fsdp_jax.train.step_parts import TokenSum
from fsdp_jax.train.trainable import trainable_leaves

__all__ = [
    "Built",
    "CompiledStep",
    "ShardedModel",
    "TokenSum",
    "TrainState",
    "abstract_state",
    "build",
    "init_train_state",
    "make_eval_step",
    "make_train_step",
    "shard_model",
    "shard_params",
    "sharding_context",
    "state_shardings",
    "trainable_leaves",
]
