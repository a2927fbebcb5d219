"""The default logical-axis rules table and how overrides merge into it: data, no JAX.

A rule maps a logical dim name (`fsdp_jax.sharding.axes`) to a mesh axis, a tuple of them, or
None (replicated). FSDP is the row `embed -> fsdp` (MaxText's `logical_axis_rules`, levanter's
`parameter_axis_mapping`). `fsdp_jax.sharding.rules` turns a leaf's names into a spec with
this table; the run config (`mesh.rules`) validates and saves it without loading JAX.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from fsdp_jax.errors import ShardingError
from fsdp_jax.sharding import axes
from fsdp_jax.sharding.axes import MeshAxes

Rules = Mapping[str, MeshAxes]

DEFAULT_RULES: Rules = {
    # activations
    axes.BATCH: (axes.DATA, axes.FSDP),
    axes.LENGTH: axes.CONTEXT,
    # parameters
    axes.EMBED: axes.FSDP,
    axes.MLP: axes.TENSOR,
    axes.HEADS: axes.TENSOR,
    axes.KV_HEADS: axes.TENSOR,
    axes.KV: None,
    axes.VOCAB: axes.TENSOR,
    axes.LAYERS: None,
    axes.NORM: None,
    axes.LORA_RANK: None,
    axes.EXPERT: None,  # experts replicated over devices (their embed dim shards over fsdp)
    axes.Q_LORA: axes.FSDP,  # latent attention's compressed widths: W_qb / W_kvb shard over fsdp here
    axes.KV_LORA: axes.FSDP,  # (W_qa / W_kva over their embed dim, which claims fsdp first)
    axes.FROZEN_ROWS: (axes.TENSOR, axes.FSDP),  # a frozen w_down / wo: fsdp on its major dim
}


def rule_entry(axes_: Sequence[str]) -> MeshAxes:
    """A rule's (or spec entry's) value for `axes_`: None, one axis, or a tuple of several."""
    axes_ = tuple(axes_)
    if not axes_:
        return None
    return axes_[0] if len(axes_) == 1 else axes_


def merge_rules(
    overrides: Mapping[str, Any] | None, base: Rules | None = None, mesh_axes: Sequence[str] = axes.MESH_AXES
) -> dict[str, MeshAxes]:
    """`base` (default DEFAULT_RULES) with `overrides` on top. A value is a mesh axis
    name, a list/tuple of them, or None. Raises ShardingError naming the logical
    name, the value and the allowed axes when a value is not one of `mesh_axes`."""
    out = dict(DEFAULT_RULES if base is None else base)
    for name, value in (overrides or {}).items():
        vals = (
            (value,)
            if value is None or isinstance(value, str)
            else (tuple(value) if isinstance(value, (list, tuple)) else (value,))
        )
        vals = tuple(v for v in vals if v is not None) if value is None else vals
        bad = [v for v in vals if not isinstance(v, str) or v not in mesh_axes]
        if not isinstance(name, str) or bad or len(set(vals)) != len(vals):
            raise ShardingError(
                f"rule {name!r}: {value!r} is not a mesh axis, a list of distinct "
                f"mesh axes or null; mesh axes: {', '.join(mesh_axes)}"
            )
        out[name] = rule_entry(vals)
    return out
