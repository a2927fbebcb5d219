"""Quantised frozen weights in a Flax NNX model: `quantize_module` swaps a module's weight
`nnx.Param`s for `QuantizedWeight` modules that hold the quantised leaves
(`fsdp_jax.quant.weight`) as `nnx.Param`s with their logical names, and give back the
weight, dequantised in `dtype`, where the model reads it (`module.wq[...]`).

So the model's code does not change, and what the step stores, shards over `fsdp` and
gathers per layer (`fsdp_jax.train.layer_gather` gathers integer leaves explicitly) are the
codes and scales; the dequantisation runs inside the layer, after the gather. A stacked
(scanned) weight keeps its leading `layers` dim on every leaf, so the scan slices the
leaves as it sliced the weight.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
from flax import linen as nn
from flax import nnx
from jax.sharding import PartitionSpec as P

from fsdp_jax.quant.weight import QuantSpec, dequantize, leaf_names, quantize
from fsdp_jax.sharding.axes import DATA, FSDP
from fsdp_jax.sharding.frozen_rows import frozen_rows_names, param_names, stack_depth


class QuantizedWeight(nnx.Module):
    """A frozen weight's quantised leaves (`nnx.Param`s named as `quantize` names them);
    `self[...]` is the weight dequantised in `dtype`."""

    def __init__(self, leaves: dict, names: dict, spec: QuantSpec, dtype: Any, shape: tuple[int, ...]):
        self.keys = tuple(sorted(leaves))
        for k in self.keys:
            setattr(self, k, nnx.Param(leaves[k], out_sharding=names[k]))
        self.spec, self.dtype, self.weight_shape = spec, jnp.dtype(dtype), tuple(shape)

    def __getitem__(self, idx):
        leaves = {k: gathered(getattr(self, k)[...], param_names(getattr(self, k))) for k in self.keys}
        return dequantize(jnp, leaves, self.spec, self.dtype)[idx]

    @property
    def shape(self) -> tuple[int, ...]:
        return self.weight_shape


def gathered(x, names):
    """`x` (a layer's leaf, logical `names`) constrained to its compute layout: the current
    rules' mesh axes for its names minus the axes params shard over at rest (`fsdp`, `data`),
    so the partitioner gathers the codes themselves before the dequantisation (left alone,
    it dequantises each shard and gathers the wider weight). Outside a mesh and rules
    context (or without names) `x` itself."""
    rules = dict(nn.get_logical_axis_rules() or ())
    mesh = jax.sharding.get_abstract_mesh()
    if not rules or names is None or mesh.empty:
        return x
    names = names[len(names) - x.ndim :]  # a scan has sliced the stack dims off
    spec = []
    for n, size in zip(names, x.shape):
        axes = rules.get(n) if n is not None else None
        axes = tuple(a for a in ((axes,) if isinstance(axes, str) else axes or ()) if a not in (FSDP, DATA))
        ok = axes and all(a in mesh.shape for a in axes) and size % math.prod(mesh.shape[a] for a in axes) == 0
        spec.append((axes[0] if len(axes) == 1 else axes) if ok else None)
    return jax.lax.with_sharding_constraint(x, P(*spec))


def quantize_module(module: nnx.Module, spec: QuantSpec, weights: dict[str, int], dtype: Any) -> nnx.Module:
    """`module` with each `nnx.Param` attribute named in `weights` (`{name: how many of its
    own leading dims its products contract}`) replaced by a `QuantizedWeight`; `dtype`: the
    dequantised weight's (the compute dtype). Stack dims are the leading `layers` names.
    ValueError (one line) naming a weight `spec` cannot quantise (`QuantSpec.problem`)."""
    for path, mod in list(nnx.iter_modules(module)):
        for attr, n_in in weights.items():
            p = getattr(mod, attr, None)
            if not isinstance(p, nnx.Param):
                continue
            names = param_names(p) or (None,) * p.ndim
            depth = stack_depth(names)
            where = "/".join(str(k) for k in path + (attr,))
            shape = tuple(p.shape)
            problem = spec.problem(where, shape[depth:])
            if problem:
                raise ValueError(problem)
            leaves = quantize(jnp, p[...], spec, depth, n_in)
            # codes laid out as the weight shard over fsdp on their leading own dim when the
            # weight's fsdp dim is its last (`fsdp_jax.sharding.frozen_rows`): the same bits, and
            # no whole-stack transposed copy on XLA:GPU; blocks run along the last dim, unsplit
            leaf_axes = {k: frozen_rows_names(v, names, depth) for k, v in leaf_names(names, spec, depth, n_in).items()}
            setattr(mod, attr, QuantizedWeight(leaves, leaf_axes, spec, dtype, shape))
    return module
