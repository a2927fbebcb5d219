"""A QLoRA run's frozen base from a float checkpoint (`init_from`, e.g. hf:DIR): loaded in
the plain layout, then quantised on the devices one weight at a time.

`load(abstract)` reads the checkpoint into the plain (unquantised) tree, each leaf sharded as
its codes will be; each quantised weight is then turned into its leaves by one jitted
`fsdp_jax.quant.weight.quantize` per weight (output sharded as the quantised leaves) and
its float copy dropped before the next. The float base is still loaded whole first (at its
sharding: 1/N per device), not streamed tensor by tensor (docs/qlora.md says so).
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp

from fsdp_jax.app.models.qlora import CONTRACTED
from fsdp_jax.quant.weight import QuantSpec, quantize


def _is_quantised(node) -> bool:
    return isinstance(node, dict) and "codes" in node


def plain_abstract(abstract_q, spec: QuantSpec, dtype=jnp.float32):
    """The unquantised base's abstract tree: each quantised weight a ShapeDtypeStruct of its
    full shape in `dtype`, sharded as its codes (same rank, dims that divide as theirs)."""

    def walk(node):
        if _is_quantised(node):
            c = node["codes"]
            shape = tuple(c.shape[:-1]) + ((c.shape[-1] * 2,) if spec.scheme == "nf4" else (c.shape[-1],))
            return jax.ShapeDtypeStruct(shape, dtype, sharding=getattr(c, "sharding", None))
        if isinstance(node, dict):
            return {k: walk(v) for k, v in node.items()}
        return node

    return walk(abstract_q)


def load_quantised(load: Callable[[Any], Any], abstract_q, spec: QuantSpec, depth: int) -> Any:
    """`load(plain_abstract)` quantised weight by weight into `abstract_q`'s layout; `depth`:
    the stack dims of the stacked layers (1 when scanned)."""
    plain = load(plain_abstract(abstract_q, spec))

    def walk(node, target, name):
        if _is_quantised(target):
            shardings = {k: getattr(v, "sharding", None) for k, v in target.items()}
            fn = jax.jit(lambda w: quantize(jnp, w, spec, depth, CONTRACTED[name]), out_shardings=shardings)
            out = fn(node)
            node.delete()  # the float copy goes before the next weight is quantised
            return out
        if isinstance(target, dict):
            return {k: walk(node[k], v, k) for k, v in target.items()}
        return node

    return walk(plain, abstract_q, "")
