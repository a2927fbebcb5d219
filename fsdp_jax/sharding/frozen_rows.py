"""Frozen weights gathered along a major dim: the logical names that move a frozen stacked
weight's fsdp sharding from its last own dim to its leading one (`FROZEN_ROWS`).

A stacked weight whose at-rest (fsdp) dim is its last own dim (`w_down` (layers, mlp, embed),
`wo` (layers, heads, kv, embed)) is gathered per layer along a minor dim. XLA:GPU wants the
gathered dim major, and for a weight the step never writes it relaid the whole stack instead:
a transposed copy of every layer, made before the layer loop and live through the step
(measured on the RTX 4090 target: 6.0 GB a device for Llama-2-70B's NF4 codes on 2 GPUs, 25 GB
for its bf16 LoRA base). Renamed, the weight shards over fsdp on its leading own dim, each
layer's slice is gathered along its major dim, and no copy is made. Only frozen weights are
renamed (a LoRA base, float or quantised): a trained weight's sharding is also its gradient's
and optimizer state's, which this change was not measured on.
"""

from __future__ import annotations

import math

from flax import linen as nn
from flax import nnx

from fsdp_jax.sharding.axes import FROZEN_ROWS, FSDP, LAYERS
from fsdp_jax.sharding.leaf_sharding import as_tuple
from fsdp_jax.sharding.rule_table import DEFAULT_RULES

# A float base's weight of fewer elements per layer keeps its trained names: its transposed copy
# is small, and renamed it would be replicated where the shard group does not divide its leading
# dim (a few heads' `wo` on 8 devices: the tiny configs' LoRA runs warned of 11% replicated).
MIN_ELEMENTS = 1 << 20


def frozen_rows_names(leaf: tuple, names: tuple, depth: int) -> tuple:
    """A frozen leaf's logical names, with its leading own dim renamed `FROZEN_ROWS` when it
    is laid out as its weight (`leaf == names`, `depth` stack dims first) and the weight
    shards at rest (the current rules, else `DEFAULT_RULES`) over fsdp on its last own dim
    but not its first; `leaf` itself otherwise."""
    rules = dict(nn.get_logical_axis_rules() or ()) or DEFAULT_RULES
    own = tuple(names[depth:])
    if tuple(leaf) != tuple(names) or len(own) < 2 or FSDP in as_tuple(rules.get(own[0])):
        return tuple(leaf)
    if FSDP not in as_tuple(rules.get(own[-1])):
        return tuple(leaf)
    return tuple(names[:depth]) + (FROZEN_ROWS,) + own[1:]


def param_names(p: nnx.Param) -> tuple | None:
    """The logical names an `nnx.Param` carries (`out_sharding` / `sharding_names` /
    `sharding` metadata), or None."""
    md = p.get_metadata()
    for key in ("out_sharding", "sharding_names", "sharding"):
        if md.get(key) is not None:
            return tuple(md[key])
    return None


def stack_depth(names: tuple) -> int:
    """How many leading `layers` dims `names` has."""
    return next((i for i, n in enumerate(names) if n != LAYERS), len(names))


def frozen_rows(module: nnx.Module, weights) -> nnx.Module:
    """`module` with each `nnx.Param` attribute named in `weights` (frozen: a LoRA base) of at
    least `MIN_ELEMENTS` per layer renamed by `frozen_rows_names`; the values and the model's code are unchanged."""
    for _, mod in list(nnx.iter_modules(module)):
        for attr in weights:
            p = getattr(mod, attr, None)
            names = param_names(p) if isinstance(p, nnx.Param) else None
            if names and math.prod(p.get_value().shape[stack_depth(names) :]) >= MIN_ELEMENTS:
                p.set_metadata(out_sharding=frozen_rows_names(names, names, stack_depth(names)))
    return module
