"""LoRA on any drop-in model (NNX, Linen, plain pytree), in one call.

    lm = with_lora(from_nnx(make), x_example, rank=16, alpha=32)            # or from_linen(...), or
    lm = with_lora(params, x_example, apply=my_apply, rank=16)              # a pytree and its apply
    sm = shard_model(lm, optax.adamw(1e-4), mesh, "full_shard", rng=key)    # adapters train, base frozen

`with_lora` traces the model's apply once on the example inputs (`jax.make_jaxpr`) and finds
the weights that are used only as an operand of matrix products (`dot_general`, also
through dtype casts, transposes, inner `jit`s and `remat`). Each targeted weight `W` gets
an adapter, A (W's contracted dims..., r) drawn as PEFT draws it and B (r, W's free
dims...) zero, so step 0 computes the base model exactly. The wrapped apply evaluates the
model's program with every targeted product in the factored form

    y = x W + scale * (x A) B        scale = alpha / r   (rslora: alpha / sqrt(r))

so the backward computes x's gradient through W and the adapters' gradients, never a
gradient of W's shape; `merged(params)` computes W + scale * A B for export only.

Params are `{"base": <the model's params>, "lora": {"<weight path>": {"lora_a", "lora_b"}}}`.
Adapters take their weight's logical names (A: the contracted dims' names + `lora_rank`,
B: `lora_rank` + the free dims' names; `lora_rank` is replicated in the rules table), so they
shard as their weight under every strategy and FSDP x TP. `shard_model` given a `LoraModel`
freezes the base (kept in its own dtype, or the precision's `frozen` dtype: no f32 master
copy, no gradients) and wraps the optimizer in `optax.masked` (state for the adapters only).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import optax

from fsdp_jax.model.fns import ModelFns, adapt_model
from fsdp_jax.model.lora_eval import AdaptedWeight, Ctx, Tracked, call, delta_weight, split_dynamic
from fsdp_jax.sharding.axes import LORA_RANK
from fsdp_jax.sharding.leaf_sharding import path_str

ALL_LINEAR = "all-linear"


def a_init(key, shape, fan_in: int, dtype=jnp.float32):
    """PEFT's A (torch nn.Linear's reset, kaiming_uniform(a=sqrt(5))): U(-1/sqrt(fan_in), 1/sqrt(fan_in))."""
    bound = 1.0 / math.sqrt(fan_in)
    return jax.random.uniform(key, shape, dtype, -bound, bound)


@dataclasses.dataclass(frozen=True)
class LoraModel(ModelFns):
    """A `ModelFns` whose params are `{"base", "lora"}` (see the module docstring).

    `targets`: the weights with adapters (`AdaptedWeight`s); `skipped`: `{path: why}` for the
    matrices left without one (used outside a product, or not matched); `scale`; `rank`."""

    targets: tuple[AdaptedWeight, ...] = ()
    skipped: Any = None
    scale: float = 1.0
    rank: int = 0

    @property
    def trainable(self) -> dict:
        """The bool tree `shard_model(trainable=)` takes: adapters train, the base is frozen."""
        return {"base": False, "lora": True}

    def optimizer(self, tx: optax.GradientTransformation) -> optax.GradientTransformation:
        """`tx` over the adapters only (`optax.masked`): no optimizer state for the base."""
        return optax.masked(tx, lambda p: {"base": jax.tree.map(lambda _: False, p["base"]), "lora": True})

    def merged(self, params) -> Any:
        """The base params with every targeted W replaced by W + scale * A B (in f32, cast
        to W's dtype): the model as one without adapters, for export."""
        by_path = {t.path: t for t in self.targets}

        def merge(path, w):
            t = by_path.get(path_str(path))
            if t is None:
                return w
            ad = params["lora"][t.path]
            return (w.astype(jnp.float32) + self.scale * delta_weight(t, ad["lora_a"], ad["lora_b"])).astype(w.dtype)

        return jax.tree_util.tree_map_with_path(merge, params["base"])


def with_lora(
    model: Any,
    *example_args,
    rank: int,
    alpha: float = 16.0,
    targets: str | Callable[[str, tuple[int, ...]], bool] | tuple[str, ...] = ALL_LINEAR,
    rslora: bool = False,
    dropout: float = 0.0,
    apply: Callable[..., Any] | None = None,
    rng: jax.Array | None = None,
    init_weights: bool = True,
    **example_kwargs,
) -> LoraModel:
    """Wrap `model` with LoRA adapters (see the module docstring).

    `model`: a `ModelFns` (`from_nnx`, `from_linen`), an `nnx.Module`, a params tree or an
    init function `rng -> params` with `apply(params, *args)` given. `example_args` /
    `example_kwargs`: inputs as the model's apply takes them (arrays or ShapeDtypeStructs).
    `targets`: `"all-linear"` (every weight used only in products), regular expressions
    matched (`re.search`) against the params' paths (`"attn/(q|v)_proj"`), or a predicate
    `(path, shape) -> bool`; a named weight used outside a product is a ValueError, as is one
    that matches nothing. `rank` in 1..min(in, out) of every target; `alpha` > 0.
    `dropout` in [0, 1): PEFT's `lora_dropout`, on each adapter's input (x A becomes
    dropout(x) A; the base product is untouched), drawn from `apply(..., lora_rng=key)` or,
    for a model called with the step's `rng=` and `train=True`, from that key; without a key
    (evaluation) there is none. Each product of each weight, and each layer of a scan, draws
    its own mask. `init_weights`: PEFT's `init_lora_weights` -- True, B starts at zero (step 0
    equals the base); False, B is drawn like A (U(+-1/sqrt(rank))), as PEFT does for tests
    and as `verify` needs: from zero, B's first Adam step is the sign of rounding-level grads.
    """
    if not isinstance(init_weights, bool):
        raise ValueError(f"with_lora: init_weights must be True or False, got {init_weights!r}")
    if not (isinstance(rank, int) and rank > 0):
        raise ValueError(f"with_lora: rank must be a positive integer, got {rank!r}")
    if not alpha > 0:
        raise ValueError(f"with_lora: alpha must be > 0, got {alpha!r}")
    if not 0.0 <= dropout < 1.0:
        raise ValueError(f"with_lora: dropout must be in [0, 1), got {dropout!r}")
    fns, params, _ = adapt_model(model, rng)
    base_apply = fns.apply if apply is None else apply
    if base_apply is None:
        raise ValueError("with_lora: this model has no apply; pass with_lora(params, *inputs, apply=fn, ...)")
    paths, leaves, names = _flat_params(fns)
    if fns.abstract_model_state is not None:  # traced as the train step calls it: with its state and a key
        example_kwargs = {"state": fns.abstract_model_state, "rng": jax.random.key(0), **example_kwargs}
    uses = _probe(base_apply, fns.abstract_params, example_args, example_kwargs)
    chosen, skipped = _choose(paths, leaves, uses, targets)
    found = tuple(_target(paths[i], leaves[i], uses[i][0], rank) for i in chosen)
    scale = alpha / (math.sqrt(rank) if rslora else rank)
    index = dict(zip(chosen, found))
    base_init = (lambda _: params) if params is not None else fns.init
    return LoraModel(
        init=_init(base_init, found, init_weights),
        apply=_apply(base_apply, index, scale, dropout),
        logical_axes=_axes(fns.logical_axes, found, index, names),
        abstract_params={"base": fns.abstract_params, "lora": _abstract_lora(found)},
        abstract_model_state=fns.abstract_model_state,
        model_state_axes=fns.model_state_axes,
        init_state=fns.init_state,
        needs_rng=fns.needs_rng,
        targets=found,
        skipped=skipped,
        scale=scale,
        rank=rank,
    )


# ----------------------------------------------------------------------------- discovery


def _flat_params(fns: ModelFns):
    flat, _ = jax.tree_util.tree_flatten_with_path(fns.abstract_params)
    paths = [path_str(p) for p, _ in flat]
    leaves = [x for _, x in flat]
    if fns.logical_axes is None:
        return paths, leaves, None
    names = jax.tree.structure(fns.abstract_params).flatten_up_to(fns.logical_axes)
    return paths, leaves, names


def _probe(base_apply, abstract, args, kwargs) -> dict[int, list]:
    """How each candidate (a floating leaf of >= 2 dims) is used by the model's program:
    `{leaf index: [("dot", contracted dims, free dims) | ("other", primitive)]}`."""
    flat, treedef = jax.tree.flatten(abstract)
    uses: dict[int, list] = {
        i: [] for i, x in enumerate(flat) if len(x.shape) >= 2 and jnp.issubdtype(x.dtype, jnp.floating)
    }

    dyn, rebuild = split_dynamic(args, kwargs)

    def run(p, d):
        tracked = [Tracked(x, None, None, i) if i in uses else x for i, x in enumerate(jax.tree.leaves(p))]
        return call(base_apply, treedef.unflatten(tracked), rebuild, d, Ctx(uses, None, 1.0))

    jax.eval_shape(run, abstract, dyn)
    return uses


def _choose(paths, leaves, uses, targets) -> tuple[list[int], dict[str, str]]:
    """(leaf indices that get adapters, {path: why not} for the other matrices)."""
    why = {}
    for i, us in uses.items():
        kinds = {u[1] if u[0] == "other" else None for u in us}
        if not us:
            why[i] = "unused by the model's apply"
        elif kinds - {None}:
            why[i] = "used by " + ", ".join(sorted(kinds - {None}))
        elif len({u[1:] for u in us}) > 1:
            why[i] = "contracted on different dims by different products"
    matrices = sorted(uses)
    if targets == ALL_LINEAR:
        return [i for i in matrices if i not in why], {paths[i]: why[i] for i in why}
    if callable(targets):
        matched = [i for i in matrices if targets(paths[i], tuple(leaves[i].shape))]
    else:
        patterns = [targets] if isinstance(targets, str) else list(targets)
        matched = [i for i in matrices if any(re.search(p, paths[i]) for p in patterns)]
    if not matched:
        raise ValueError(
            f"with_lora: targets={targets!r} match no weight; the matrices are: " + " ".join(paths[i] for i in matrices)
        )
    bad = [i for i in matched if i in why]
    if bad:
        raise ValueError(f"with_lora: {paths[bad[0]]} is not a matrix product's weight ({why[bad[0]]})")
    rest = {paths[i]: why.get(i, "not in targets") for i in matrices if i not in matched}
    return matched, rest


def _target(path, leaf, use, rank) -> AdaptedWeight:
    _, contracted, free, depth, *more = use
    batch = more[0] if more else ()  # a batched product's W dims paired with the input's
    shape = tuple(leaf.shape)
    n_in, n_out = math.prod(shape[d] for d in contracted), math.prod(shape[d] for d in free)
    if rank > min(n_in, n_out):
        raise ValueError(f"with_lora: rank {rank} is larger than {path}'s smaller dim ({min(n_in, n_out)})")
    lead = shape[:depth] + tuple(shape[d] for d in batch)
    a_shape = lead + tuple(shape[d] for d in contracted) + (rank,)
    b_shape = lead + (rank,) + tuple(shape[d] for d in free)
    return AdaptedWeight(path, shape, contracted, free, a_shape, b_shape, depth, batch)


def _abstract_lora(found) -> dict:
    return {
        t.path: {
            "lora_a": jax.ShapeDtypeStruct(t.a_shape, jnp.float32),
            "lora_b": jax.ShapeDtypeStruct(t.b_shape, jnp.float32),
        }
        for t in found
    }


def _axes(base_axes, found, index, names) -> Any:
    if names is None:
        return None
    by_path = {t.path: names[i] for i, t in index.items()}
    lora = {}
    for t in found:
        n = tuple(by_path[t.path] or ()) + (None,) * len(t.shape)
        lead = n[: t.depth] + tuple(n[d] for d in t.batch)
        a = lead + tuple(n[d] for d in t.contracted) + (LORA_RANK,)
        b = lead + (LORA_RANK,) + tuple(n[d] for d in t.free)
        lora[t.path] = {"lora_a": a if by_path[t.path] else None, "lora_b": b if by_path[t.path] else None}
    return {"base": base_axes, "lora": lora}


def _init(base_init, found, zero_b: bool = True):
    def b_init(t, k):
        if zero_b:
            return jnp.zeros(t.b_shape, jnp.float32)
        rank = t.b_shape[t.depth + len(t.batch)]
        return a_init(jax.random.fold_in(k, 0xB), t.b_shape, rank)  # fan-in: the rank

    def init(rng):
        keys = jax.random.split(jax.random.fold_in(rng, 0x10A), max(len(found), 1))
        lora = {
            t.path: {
                "lora_a": a_init(k, t.a_shape, math.prod(t.a_shape[t.depth + len(t.batch) : -1])),
                "lora_b": b_init(t, k),
            }
            for t, k in zip(found, keys)
        }
        return {"base": base_init(rng), "lora": lora}

    return init


def _apply(base_apply, index: dict[int, AdaptedWeight], scale: float, dropout: float):
    def apply(params, *args, lora_rng=None, **kwargs):
        flat, treedef = jax.tree.flatten(params["base"])
        tracked = [
            Tracked(x, params["lora"][index[i].path]["lora_a"], params["lora"][index[i].path]["lora_b"], i)
            if i in index
            else x
            for i, x in enumerate(flat)
        ]
        if lora_rng is None and kwargs.get("rng") is not None and kwargs.get("train", True):
            lora_rng = jax.random.fold_in(kwargs["rng"], 0x10A)  # the step's key, as the model's own streams
        dyn, rebuild = split_dynamic(args, kwargs)
        ctx = Ctx(None, index, scale, dropout, lora_rng if dropout else None)
        return call(base_apply, treedef.unflatten(tracked), rebuild, dyn, ctx)

    return apply
