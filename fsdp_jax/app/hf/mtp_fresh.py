"""Multi-token prediction depths a checkpoint does not hold, initialised fresh on import.

A run with `model.mtp_depth` D from `init_from: hf:` of a checkpoint holding fewer MTP layers
(most published DeepSeek-V3 derivatives and every other family's checkpoint hold none) reads
the depths it has and starts the others as a fresh run would: the model's own init with the
run's seed (`train.seed`), only those depths' leaves computed (one jitted init whose other
outputs XLA drops), laid out as the plan wants. MaxText and Megatron-LM do the same: their MTP
blocks start from the model's initialiser when a converted checkpoint has none. The trainer says
so in one line (`line`); an export then writes every depth in the family's checkpoint layout
(`mtp_layout`).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import NamedSharding

from fsdp_jax.checkpoint.manifest import tree_paths


def missing_depths(depth: int, held: int) -> tuple[int, ...]:
    """The 0-based MTP depths a run of `depth` depths needs beyond the `held` a checkpoint holds."""
    return tuple(range(held, depth))


def fresh_paths(paths, depths: tuple[int, ...]) -> list[str]:
    """Our param paths (`mtp/<k>/...`) of the MTP depths `depths`, in `paths`' order."""
    prefixes = tuple(f"mtp/{k}/" for k in depths)
    return [p for p in paths if prefixes and p.startswith(prefixes)]


def initialiser(init: Callable, key: jax.Array, abstract_params) -> Callable[[list[str]], dict]:
    """`make(paths) -> {path: array}`: those leaves of `init(key)` (the model's fresh init, as
    `Built.init_state(key)` draws it), cast to `abstract_params`' dtypes and laid out on its
    shardings, without materialising the rest of the model."""
    want = tree_paths(abstract_params)

    def make(paths: list[str]) -> dict:
        def pick(k):
            full = tree_paths(init(k))
            return [full[p].astype(want[p].dtype) for p in paths]

        shardings = [getattr(want[p], "sharding", None) for p in paths]
        mesh = next((s.mesh for s in shardings if isinstance(s, NamedSharding)), None)
        if mesh is None:
            return dict(zip(paths, jax.jit(pick)(key)))
        with jax.set_mesh(mesh):
            return dict(zip(paths, jax.jit(pick, out_shardings=shardings)(key)))

    return make


def line(path, depth: int, held: int) -> str:
    """The trainer's one log line for a checkpoint lacking MTP depths."""
    fresh = missing_depths(depth, held)
    names = ", ".join(str(k + 1) for k in fresh)
    return (
        f"model.mtp_depth {depth}: hf:{path} holds {held} MTP layer{'s' if held != 1 else ''}; "
        f"depth{'s' if len(fresh) > 1 else ''} {names} initialised fresh (the model's init, train.seed)"
    )
