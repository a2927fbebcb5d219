"""Generation over the training mesh: the policy samples from its own shards.

`make_sampler(model, plan, spec)` jits `models.generate.generate` with the params in the
plan's at-rest layout (`plan.params`: 1/N per device under full_shard) and the rows sharded
over the batch axes (`plan.batch`). Nothing is copied to a separate sampler: the partitioner
gathers each layer's params inside the layer scan, as the forward of a train step does (so a
decode step's peak holds one gathered layer plus the sharded KV cache, whose batch dim
splits over data x fsdp). The rows must divide by data x fsdp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.app.models.generate import SamplingSpec, generate
from fsdp_jax.model.fns import ModelFns
from fsdp_jax.sharding.strategy import ShardingPlan
from fsdp_jax.train.step import sharding_context


def make_sampler(model: ModelFns, plan: ShardingPlan, spec: SamplingSpec, cast=None, return_logits: bool = False):
    """`sample(params, prompts (B, P) int32, lengths (B,) int32, key) -> {"tokens" (B, N),
    "lengths" (B,)[, "logits" (B, N, V)]}`: `params` in `plan.params` layout, `cast(params)`
    to the compute dtype first (e.g. `Policy.cast_to_compute`), prompts left-padded."""
    cast = cast or (lambda p: p)

    def fn(params, prompts, lengths, key):
        return generate(model.bind(cast(params)), prompts, lengths, key, spec, return_logits)

    rep = NamedSharding(plan.mesh, P())
    jitted = jax.jit(fn, in_shardings=(plan.params, plan.batch, plan.batch, rep), out_shardings=plan.batch)

    def sample(params, prompts, lengths, key):
        with sharding_context(plan):
            return jitted(params, jnp.asarray(prompts, jnp.int32), jnp.asarray(lengths, jnp.int32), key)

    return sample
