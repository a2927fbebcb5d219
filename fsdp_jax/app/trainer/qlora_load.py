"""A QLoRA run's frozen base from a float checkpoint (`init_from`, e.g. hf:DIR), quantised on
the devices as it lands.

From a Hugging Face checkpoint (`load_quantised(..., ckpt=...)`) each quantised weight is
streamed: unscanned layers (`model.scan_layers=false`) weight by weight, each read, placed,
quantised and dropped before the next is read; with scanned layers each stacked weight layer
by layer: one layer's float slices are read and placed
(`fsdp_jax.app.hf.load.load_layer`), quantised by one jitted
`fsdp_jax.quant.weight.quantize` into that layer's leaves and written into the stacked leaves
in place (donated), so the host holds one layer's block at a time and the devices one float
layer besides the codes. The other leaves (embeddings, norms, head; weights not quantised)
load as usual. Without a checkpoint to stream from (another `load`: a run's own
checkpoint) the float base is loaded whole at its sharding (1/N per device) and quantised
weight by weight.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.app.hf.load import load_layer, load_params
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


def load_quantised(load: Callable[[Any], Any], abstract_q, spec: QuantSpec, depth: int, ckpt=None) -> Any:
    """`load(plain_abstract)` quantised weight by weight into `abstract_q`'s layout; `depth`:
    the stack dims of the stacked layers (1 when scanned). `ckpt` (an
    `fsdp_jax.app.hf.load.HFCheckpoint`): stream its stacked weights layer by layer instead."""
    plain_tree = plain_abstract(abstract_q, spec)
    targets = {p: t for p, t in _quantised_paths(abstract_q).items() if ckpt is not None and depth in (0, 1)}
    plain = load(plain_tree) if not targets else load_params(ckpt, plain_tree, frozenset(targets))
    stream = _stream if depth == 1 else _one
    streamed = {p: stream(ckpt, p, t, spec) for p, t in targets.items()}

    def walk(node, target, name, path):
        if _is_quantised(target):
            if path in streamed:
                return streamed[path]
            shardings = {k: getattr(v, "sharding", None) for k, v in target.items()}
            fn = jax.jit(lambda w: quantize(jnp, w, spec, depth, CONTRACTED[name]), out_shardings=shardings)
            out = fn(node)
            node.delete()  # the float copy goes before the next weight is quantised
            return out
        if isinstance(target, dict):
            return {k: walk(node[k], v, k, f"{path}/{k}" if path else k) for k, v in target.items()}
        return node

    return walk(plain, abstract_q, "", "")


def _quantised_paths(abstract_q) -> dict[str, dict]:
    """{path of the weight, as `tree_paths` names its plain leaf: its quantised leaves}."""
    out = {}

    def walk(node, path):
        if _is_quantised(node):
            out[path] = node
        elif isinstance(node, dict):
            for k, v in node.items():
                walk(v, f"{path}/{k}" if path else k)

    walk(abstract_q, "")
    return out


def _one(ckpt, path: str, target: dict, spec: QuantSpec) -> dict:
    """The quantised leaves of weight `path` of one unscanned layer (`target`: their abstract
    values): its float tensor read and placed as its codes are sharded, quantised, dropped."""
    name = path.rsplit("/", 1)[-1]
    shardings = {k: v.sharding for k, v in target.items()}
    w = load_layer(ckpt, path, 0, plain_abstract({"w": target}, spec)["w"])  # its one checkpoint tensor
    out = jax.jit(lambda w: quantize(jnp, w, spec, 0, CONTRACTED[name]), out_shardings=shardings)(w)
    w.delete()  # the float weight goes before the next is read
    return out


def _stream(ckpt, path: str, target: dict, spec: QuantSpec) -> dict:
    """The stacked quantised leaves of weight `path` (`target`: their abstract values),
    filled layer by layer from `ckpt`."""
    name = path.rsplit("/", 1)[-1]
    shardings = {k: v.sharding for k, v in target.items()}
    layer = {k: NamedSharding(s.mesh, P(*tuple(s.spec)[1:])) for k, s in shardings.items()}
    plain = plain_abstract({"w": target}, spec)["w"]
    layer_w = jax.ShapeDtypeStruct(plain.shape[1:], plain.dtype, sharding=layer["codes"])
    zeros = jax.jit(lambda: {k: jnp.zeros(v.shape, v.dtype) for k, v in target.items()}, out_shardings=shardings)
    one = jax.jit(lambda w: quantize(jnp, w, spec, 0, CONTRACTED[name]), out_shardings=layer)
    put = jax.jit(
        lambda out, q, i: {k: jax.lax.dynamic_update_index_in_dim(out[k], q[k], i, 0) for k in out},
        out_shardings=shardings,
        donate_argnums=0,
    )
    out = zeros()
    for i in range(plain.shape[0]):
        w = load_layer(ckpt, path, i, layer_w)
        out = put(out, one(w), i)
        w.delete()  # the float layer goes before the next is read
    return out
