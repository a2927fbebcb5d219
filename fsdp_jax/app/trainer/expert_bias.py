"""DeepSeek-V3's auxiliary-loss-free load balancing (the report's sec. 2.1.2) in the trainer.

Each sparse layer's score-correction bias b_l (E,) (`score_bias`, transformers'
`e_score_correction_bias`) picks the experts but weighs none (`models/moe_grouped.py`). After
every optimizer step it moves by that step's loads, not by a gradient:

    b_l,e += u * sign(mean_e' c_l,e' - c_l,e)

c_l,e the tokens layer l routed to expert e in the step (the whole global batch: every
microbatch and device, masked tokens left out; `RouterStats.layer_counts`), u =
`model.bias_update_speed` (the report: 0.001 for most of pre-training, then 0; 0 = the bias
stays as imported). An overloaded expert's bias falls, an underloaded one's rises.

The rule is the train step's `post_update` (`fsdp_jax.train.make_train_step`): it runs after the
optimizer update, inside the jitted step, and a skipped (non-finite) step moves nothing. The
bias takes no gradient (stop_gradient in the router), no weight decay (`optim.decay_mask`) and,
with u > 0, keeps no optimizer state (`without_bias_state`: `optax.masked`). It stays a param,
so checkpoints carry it and a resume continues it exactly. The counts are sums over the global
arrays of the jitted program, so every strategy and expert parallelism sees the same loads.

torchtitan (`load_balance_coeff`; `tokens_per_expert` buffers summed over the data-parallel
ranks in an optimizer pre-step hook that adds to an `expert_bias` buffer) also subtracts each
layer's mean update; the report's rule does not, and neither does this one.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import optax

from fsdp_jax.app.models.stack import segment_layers
from fsdp_jax.sharding.leaf_sharding import path_str

BIAS = "score_bias"  # the param the rule moves (models/moe_grouped.py)
COUNTS = "expert_counts"  # the router aux's per-layer counts (L, E) (`router_metrics.router_aux`)


def balancing(model_cfg) -> bool:
    """Whether a run moves the score-correction bias by the rule (`bias_update_speed` > 0)."""
    return bool(model_cfg is not None and model_cfg.bias_update_speed)


def _is_bias(path) -> bool:
    return path_str(path).rsplit("/", 1)[-1] == BIAS


def without_bias_state(optimizer: optax.GradientTransformation) -> optax.GradientTransformation:
    """`optimizer` keeping no state for the bias (its zero gradient passes through unchanged)."""
    return optax.masked(
        optimizer, lambda params: jax.tree_util.tree_map_with_path(lambda p, _: not _is_bias(p), params)
    )


def step_counts(aux) -> jax.Array:
    """The step's per-layer counts (L, E) from a loss's aux: `aux[COUNTS]`, or nested under a
    preference loss's `router`, summed over a leading microbatch dim."""
    found = aux.get(COUNTS) if isinstance(aux, dict) else None
    if found is None and isinstance(aux, dict):
        found = next((step_counts(v) for v in aux.values() if isinstance(v, dict) and _has_counts(v)), None)
    if found is None:
        raise ValueError(f"the loss's aux carries no {COUNTS!r}: the bias rule needs a router loss")
    return found.reshape((-1,) + found.shape[-2:]).sum(0)


def _has_counts(aux: dict) -> bool:
    return COUNTS in aux or any(isinstance(v, dict) and _has_counts(v) for v in aux.values())


def moved(bias, counts, speed: float):
    """The rule on one bias (E,) or a stack of them (G, E), with its layers' counts alike."""
    c = counts.astype(jnp.float32)
    step = speed * jnp.sign(jnp.mean(c, axis=-1, keepdims=True) - c)
    return (bias.astype(jnp.float32) + step).astype(bias.dtype)


def bias_rule(model_cfg) -> Callable:
    """`post_update(params, aux) -> params` for `make_train_step`: every `score_bias` leaf (at
    `segments/<j>/layers/<m>/...` stacked over its segment's groups, or `segments/<i>/...`
    unscanned) moved by the counts of the layers it holds (`stack.segment_layers`)."""
    speed = float(model_cfg.bias_update_speed)
    layers_of = [(prefix + "/", layers) for prefix, layers, sparse in segment_layers(model_cfg) if sparse]

    def rule(params, aux):
        counts = step_counts(aux)  # (L, E)

        def move(path, leaf):
            if not _is_bias(path):
                return leaf
            name = path_str(path)
            layers = next(ls for prefix, ls in layers_of if name.startswith(prefix))
            c = counts[jnp.asarray(layers)]  # (G, E): the stack's layers
            return moved(leaf, c if leaf.ndim == 2 else c[0], speed)

        return jax.tree_util.tree_map_with_path(move, params)

    return rule
