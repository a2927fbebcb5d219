"""FP8 projections in a Flax NNX model: `attach(module, recipe, weights)` marks the module's
weights (by attribute name) as FP8 matmul weights, and, for a delayed recipe, gives each an
`Fp8Meta` variable holding its amax histories; the model computes each projection as
`project(module, name, x, w, shape2d)`, which is `precision.matmul(x, w.reshape(shape2d))`
for a module without FP8 and `fp8.scaled_matmul` with the recipe's scales for one with.

The histories are NNX variables that are not `nnx.Param`s, so the train step carries them
as model state (`TrainState.model_state`, `fsdp_jax.model.variables`): donated, checkpointed
and restored with the rest, threaded through microbatches, kept or skipped with the update.
A stacked (scanned) block stacks its histories over layers as it stacks its weights.
The output gradient's history (`grad_meta_name`) is written by the backward pass: its name
ends with `variables.FROM_GRADIENT`, so the train step differentiates the loss with respect
to it and keeps the cotangent (the history with this step's gradient amax pushed) as its new
value. A weight's projection must run once per forward pass (two uses would add their
cotangents; Flax's fp8_ops meet that with a max-accumulating dtype, `fp32_max_grad`).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from fsdp_jax.model.variables import FROM_GRADIENT
from fsdp_jax.quant import fp8, fp8_rowwise
from fsdp_jax.sharding import precision
from fsdp_jax.train import layer_gather

FP8_ATTR = "fp8_recipe"  # the module attribute holding its Fp8Recipe (static: in the graphdef)


class Fp8Meta(nnx.Variable):
    """FP8 amax histories, float32, newest first (`fp8.push`): a weight's (2, L), row 0 the
    input's, row 1 the weight's; its output gradient's (L,) (`grad_meta_name`). Model
    state, never trained."""


def meta_name(weight: str) -> str:
    return f"fp8_{weight}_amax"


def grad_meta_name(weight: str) -> str:
    """The attribute holding the (L,) amax history of the output gradient of `weight`'s projection."""
    return f"fp8_{weight}_grad_amax{FROM_GRADIENT}"


def fills_with_zeros(path: str) -> bool:
    """Whether a model-state leaf at `path` ("model_state/.../fp8_wq_grad_amax_from_grad") is
    an FP8 history written by the backward pass: the output-gradient histories and the
    per-expert (E, 3, L) histories, which delayed-recipe checkpoints written before them lack.
    All zeros is a fresh history (the scale comes from the current amax), so a restore may
    create them as zeros (`fsdp_jax.checkpoint.fits`)."""
    name = path.rsplit("/", 1)[-1]
    return path.startswith("model_state/") and name.startswith("fp8_") and name.endswith(FROM_GRADIENT)


def attach(module: nnx.Module, recipe: fp8.Fp8Recipe | None, weights: tuple[str, ...]) -> nnx.Module:
    """`module` with `recipe` for the projections whose weights are the attributes named in
    `weights` (those it has), and zeroed histories for a delayed recipe. None: unchanged."""
    if recipe is None:
        return module
    setattr(module, FP8_ATTR, recipe)
    if recipe.delayed:
        for w in weights:
            if getattr(module, w, None) is not None:
                setattr(module, meta_name(w), Fp8Meta(jnp.zeros((2, recipe.amax_history), jnp.float32)))
                setattr(module, grad_meta_name(w), Fp8Meta(jnp.zeros((recipe.amax_history,), jnp.float32)))
    return module


def expert_meta_name(weight: str) -> str:
    """The attribute holding routed experts' (E, 3, L) histories for the expert weight `weight`."""
    return f"fp8_{weight}_amax{FROM_GRADIENT}"


def attach_experts(module: nnx.Module, recipe: fp8.Fp8Recipe | None, weights: tuple[str, ...], n_experts: int):
    """`module` (a sparse MLP) with `recipe` for its routed experts' GEMMs and, for a delayed
    recipe, a history per expert for each expert weight named in `weights`: (E, 3, L) float32,
    rows input, weight, output gradient (`fsdp_jax.quant.fp8_experts`). All three are written by
    the backward pass (the names end with `FROM_GRADIENT`). None: unchanged."""
    if recipe is None:
        return module
    setattr(module, FP8_ATTR, recipe)
    if recipe.delayed:
        for w in weights:
            setattr(module, expert_meta_name(w), Fp8Meta(jnp.zeros((n_experts, 3, recipe.amax_history), jnp.float32)))
    return module


def expert_histories(module, weights: tuple[str, ...]) -> tuple | None:
    """The values of `attach_experts`' histories for `weights`, in that order; None without them."""
    recipe = recipe_of(module)
    if recipe is None or not recipe.delayed:
        return None
    return tuple(getattr(module, expert_meta_name(w))[...] for w in weights)


def recipe_of(module) -> fp8.Fp8Recipe | None:
    return getattr(module, FP8_ATTR, None)


def _names(v) -> tuple | None:
    if not isinstance(v, nnx.Variable):
        return None
    md = v.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if md.get(key) is not None:
            return tuple(md[key])
    return None


def project(module, name: str, x, w, shape2d: tuple[int, int]):
    """`x` (..., K) @ the module's weight `name` (its value `w`, any rank, used as `shape2d`
    = (K, N)). FP8 when `module` has a recipe (`attach`), else `precision.matmul`. A
    delayed recipe pushes this call's input and weight amaxes into the weight's histories."""
    recipe = recipe_of(module)
    if recipe is None:
        return precision.matmul(x, w.reshape(shape2d))
    if recipe.rowwise:  # cast after the gather (`fp8.gather` does not apply; docs/fp8.md)
        return fp8_rowwise.rowwise_matmul(x, w.reshape(shape2d), reduce_dtype=precision.step_reduce_dtype())
    layouts = None
    if recipe.gather:
        lay = layer_gather.per_use_layouts(w.shape, w.dtype, _names(getattr(module, name, None)))
        layouts = None if lay is None else (*lay, tuple(shape2d))
    ax, aw = fp8.amax(x), fp8.amax(w)
    gh = None
    if recipe.delayed:
        meta = getattr(module, meta_name(name))
        hist = meta[...]
        sx, sw = fp8.history_scale(hist[0], ax, fp8.E4M3), fp8.history_scale(hist[1], aw, fp8.E4M3)
        meta[...] = jnp.stack([fp8.push(hist[0], ax), fp8.push(hist[1], aw)])
        gh = getattr(module, grad_meta_name(name))[...]  # written back by the step, from its cotangent
    else:
        sx, sw = fp8.scale_for(ax, fp8.E4M3), fp8.scale_for(aw, fp8.E4M3)
    if layouts is None:
        w = w.reshape(shape2d)
    rd = precision.step_reduce_dtype()
    return fp8.scaled_matmul(x, w, sx, sw, reduce_dtype=rd, layouts=layouts, grad_history=gh)
