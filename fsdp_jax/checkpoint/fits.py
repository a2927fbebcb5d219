"""Whether a saved state fits a restore target, and the leaves a restore may create.

A restore target names every leaf it wants (`manifest.tree_paths`); the saved state must
hold each with the same shape (`shape_mismatches` lists those that do not). One exception,
asked for by the caller: leaves that a newer version of the model added and whose zero
value means "nothing recorded yet" may be absent from an older checkpoint, and are then
created as zeros (`fill_missing`, a predicate on leaf paths). FP8's delayed recipe is the
case in point: its gradient and per-expert amax histories (`fsdp_jax.quant.fp8_modules.
fills_with_zeros`) came after its input and weight histories, and an all-zero history is
what a fresh run starts from (its scale is taken from the current amax). A leaf the
predicate accepts but that is saved with another shape is still a mismatch.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from fsdp_jax.checkpoint.manifest import shape_mismatches, tree_paths
from fsdp_jax.errors import CheckpointError


def compared(saved: dict[str, Any], target) -> tuple[dict[str, Any], dict[str, Any]]:
    """(the saved leaves `target` is compared with, `target`'s leaves), both by path. A
    partial target ({"params": ...}) checks its part; a whole TrainState also checks the
    model state on either side (a checkpoint with model state does not fit a model without)."""
    want = tree_paths(target)
    tops = {p.split("/")[0] for p in want}
    if {"params", "opt_state"} <= tops:
        tops.add("model_state")
    return {p: m for p, m in saved.items() if p.split("/")[0] in tops}, want


def fillable(saved: dict[str, Any], target, fill_missing: Callable[[str], bool] | None) -> tuple[str, ...]:
    """Paths of `target`'s leaves absent from `saved` that `fill_missing` accepts, sorted."""
    if fill_missing is None:
        return ()
    saved, want = compared(saved, target)
    return tuple(sorted(p for p in want if p not in saved and fill_missing(p)))


def check_fits(step_dir: Path, saved: dict[str, Any], target, filled: tuple[str, ...] = ()) -> None:
    """CheckpointError listing the paths whose saved shapes differ from `target`'s; the
    paths in `filled` may be absent (they are created as zeros)."""
    saved, want = compared(saved, target)
    bad = shape_mismatches(saved, {p: t for p, t in want.items() if p not in filled})
    if bad:
        raise CheckpointError(
            f"checkpoint {step_dir} does not fit the model ({'; '.join(bad)}); "
            "the model config differs from the run that saved it: restore with that config "
            "or start a new run_dir (init_from can start from its exported params)"
        )


def without(target, paths: tuple[str, ...]):
    """`target` with the leaves at `paths` replaced by None (an empty subtree: not read)."""
    if not paths:
        return target
    names = list(tree_paths(target))
    flat, treedef = jax.tree_util.tree_flatten(target)
    return jax.tree_util.tree_unflatten(treedef, [None if n in paths else t for n, t in zip(names, flat)])


def with_zeros(state, target, paths: tuple[str, ...]):
    """`state` (read as `without(target, paths)`) with zeros laid out as `target`'s leaves
    (ShapeDtypeStructs with shardings) at `paths`; each process makes only its own shards."""
    if not paths:
        return state
    names = list(tree_paths(target))
    flat, treedef = jax.tree_util.tree_flatten(target)
    got = iter(jax.tree_util.tree_flatten(state)[0])
    out = [_zeros(t) if n in paths else next(got) for n, t in zip(names, flat)]
    return jax.tree_util.tree_unflatten(treedef, out)


def _zeros(t):
    def block(index):  # this device's slice of the leaf
        return np.zeros([len(range(*i.indices(d))) for i, d in zip(index, t.shape)], t.dtype)

    return jax.make_array_from_callback(t.shape, t.sharding, block)


def filled_note(step_dir: Path, filled: tuple[str, ...], limit: int = 8) -> str:
    """One line: which leaves a restore of `step_dir` created as zeros, and how many."""
    shown = ", ".join(filled[:limit]) + (f" and {len(filled) - limit} more" if len(filled) > limit else "")
    return (
        f"checkpoint {step_dir} was written before {len(filled)} leaves of this model's state existed; "
        f"they start as zeros (a fresh history): {shown}"
    )
