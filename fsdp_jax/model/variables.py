"""The model's non-trainable state and per-step randomness, through the jitted step.

Many models hold variables that are not trained: BatchNorm running statistics (Linen
`batch_stats`, NNX `BatchStat`), counters, any other NNX `Variable` that is not a
`Param`. They live in `TrainState.model_state` beside params and optimizer state,
sharded like params at rest (`fsdp_jax.sharding.strategy.make_plan`), donated, checkpointed and
restored with the rest. RNG keys and counters (NNX `RngState`) are not state: the step
hands the model a fresh key each step instead.

The loss contract (the extended call). When the model has state, or the step is given
a run key (`make_train_step(..., rng=key)`), the step calls

    loss_fn(params, batch, state=model_state, rng=key, train=True)

and, when the model has state, `loss_fn` returns `(loss, new_state)` (with `has_aux`:
`((loss, aux), new_state)`), as Flax's `apply(..., mutable=[...])` returns
`(out, updates)`. `new_state` must have the structure and shapes of `state`. Eval calls
it with `rng=None, train=False` and ignores the state it returns. The adapters'
`apply(params, *args, state=, rng=, train=)` does the model's half of this.

State written by the backward pass (Flax's `OVERWRITE_WITH_GRADIENT`): a model-state leaf
whose name ends with `FROM_GRADIENT` is an input the loss is differentiated with respect to,
and its new value is that gradient (its cotangent), not what the forward returned. A
`custom_vjp` hands a value out of the backward pass this way: FP8's output-gradient amax
histories (`fsdp_jax.quant.fp8_modules.grad_meta_name`). Such a leaf must be used once per
forward pass (cotangents of several uses add up).

Randomness: the key of step `s` is `fold_in(run_key, s)`, and microbatch `j` of `k > 1`
gets `fold_in(that, j)`. `jax.random` bits do not depend on the device count (docs/design.md),
so dropout is the same on 1 and N devices, under every strategy, and after a resume.
Microbatches thread the state: microbatch j sees the state microbatch j-1 returned
(as PyTorch's BatchNorm does under gradient accumulation).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from fsdp_jax.errors import StateError
from fsdp_jax.sharding import rules
from fsdp_jax.sharding.leaf_sharding import spec_str

# model-state leaves named `<name>_from_grad` take their gradient as their new value (above)
FROM_GRADIENT = "_from_grad"


def from_gradient(state) -> tuple[int, ...]:
    """Indices (in `jax.tree.leaves(state)` order) of the leaves whose last key ends with
    `FROM_GRADIENT`; () for None or a state without any."""
    if state is None:
        return ()
    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return tuple(i for i, (p, _) in enumerate(flat) if p and str(_key(p[-1])).endswith(FROM_GRADIENT))


def take(state, idx: tuple[int, ...]) -> list:
    leaves = jax.tree.leaves(state)
    return [leaves[i] for i in idx]


def put(state, idx: tuple[int, ...], values) -> Any:
    """`state` with its leaves at `idx` replaced by `values` (as `take` gave them)."""
    leaves, treedef = jax.tree.flatten(state)
    for i, v in zip(idx, values):
        leaves[i] = v
    return jax.tree.unflatten(treedef, leaves)


def _key(k):
    return getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))


class StepInput(NamedTuple):
    """What the step's grad function receives in place of the batch in the extended
    call: the batch, the model state before it, the step's key (or None)."""

    batch: Any
    state: Any
    rng: Any

    def for_microbatch(self, batch, state, j) -> "StepInput":
        """Microbatch `j`'s input: its slice, the state so far, `fold_in(rng, j)`."""
        return StepInput(batch, state, None if self.rng is None else jax.random.fold_in(self.rng, j))


def run_key(rng) -> jax.Array | None:
    """A run key as raw uint32 key data (a jit constant that every device sees alike),
    from a typed key, raw key data or an int seed; None stays None."""
    if rng is None:
        return None
    if isinstance(rng, int):
        rng = jax.random.key(rng)
    if jnp.issubdtype(getattr(rng, "dtype", None), jax.dtypes.prng_key):
        rng = jax.random.key_data(rng)
    return jnp.asarray(rng, jnp.uint32)


def step_key(key_data, step) -> jax.Array:
    """Inside jit: the typed key of `step`, `fold_in(run key, step)`."""
    return jax.random.fold_in(jax.random.wrap_key_data(key_data), step)


def check_structure(new, like, what: str) -> None:
    """StateError unless `new` has `like`'s tree structure and leaf shapes."""
    if jax.tree.structure(new) != jax.tree.structure(like):
        a, b = set(_paths(new)), set(_paths(like))
        extra, missing = sorted(a - b), sorted(b - a)
        detail = (
            f"it has {extra[0]} which the model state has not"
            if extra
            else f"it lacks {missing[0]}"
            if missing
            else f"its structure {jax.tree.structure(new)} differs"
        )
        raise StateError(
            f"{what} does not match the model state: {detail}; return the state "
            "the model's apply gave back, with every collection it was given"
        )
    for (p, x), y in zip(jax.tree_util.tree_flatten_with_path(new)[0], jax.tree.leaves(like)):
        if tuple(jnp.shape(x)) != tuple(y.shape):
            raise StateError(
                f"{what}: model state leaf {rules.path_str(p)} changed shape {tuple(y.shape)} -> {tuple(jnp.shape(x))}"
            )


def split_output(out, state, has_aux: bool):
    """(loss_fn's usual output, new state) from the extended call's `(out, new_state)`;
    StateError when the loss did not return the state, or one of another structure.
    The new state is cast to the old one's dtypes."""
    n = len(jax.tree.leaves(state))
    if not (isinstance(out, tuple) and len(out) == 2) or (
        has_aux and not (isinstance(out[0], tuple) and len(out[0]) == 2)
    ):
        want = "((loss, aux), new_state)" if has_aux else "(loss, new_state)"
        raise StateError(
            f"loss_fn returned {_describe(out)}, not {want}: the model has state "
            f"({n} leaves, e.g. {_paths(state)[0]}); return the state its apply gave "
            "back (apply(params, x, state=state, rng=rng, train=train) -> (out, state))"
        )
    body, new = out
    check_structure(new, state, "the state loss_fn returned")
    new = jax.tree.map(lambda x, y: jnp.asarray(x).astype(y.dtype), new, state)
    return body, new


def rows_lines(rows) -> list[str]:
    """`explain()` lines for the model state's leaves (`state:` prefixed paths)."""
    width = max((len(r.path) for r in rows), default=0) + 6
    return [
        f"{'state:' + r.path:<{width}}  {str(r.shape):<16} {spec_str(r.spec):<28} "
        f"{r.bytes_per_device:>10} B/device  {r.reason} (model state, not trained)"
        for r in rows
    ]


def _paths(tree) -> list[str]:
    return [rules.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]] or ["<root>"]


def _describe(out) -> str:
    if isinstance(out, tuple):
        return f"a tuple of {len(out)}"
    return f"a {type(out).__name__}" + (f" of shape {tuple(out.shape)}" if hasattr(out, "shape") else "")


# ----------------------------------------------------------------------------- in the step


def with_model_state(new, aux, state, ok, skip_nonfinite: bool):
    """(`new` carrying the loss's new model state, the user's aux) from the extended
    loss's `(aux, new model state)`; the old model state is kept when the step is skipped."""
    aux, new_ms = aux
    if skip_nonfinite:
        new_ms = jax.tree.map(lambda n, o: jnp.where(ok, n, o), new_ms, state.model_state)
    return new.replace(model_state=new_ms), aux


def extended_loss(loss_fn, stateful: bool, has_aux: bool, train: bool = True):
    """`(params, StepInput) -> (loss, (aux, new model state))` around the extended call
    `loss_fn(params, batch, state=, rng=, train=)` (see above)."""

    def f(params, inp: StepInput):
        out = loss_fn(params, inp.batch, state=inp.state, rng=inp.rng, train=train)
        new = None
        if stateful:
            out, new = split_output(out, inp.state, has_aux)
        loss, aux = out if has_aux else (out, None)
        return loss, (aux, new)

    return f
