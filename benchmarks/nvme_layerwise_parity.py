"""Layer-wise programs against the scanned step: are loss and grads bit for bit? (issue 61)

`optimizer+params:nvme` is planned as a layer-wise driver (docs/offload.md "Params on disk"):
the embedding, each decoder layer and the head as their own jitted programs, the forward
keeping each layer's input, the backward running each layer's `jax.vjp` in reverse. This
measures what such programs compute against `jax.value_and_grad` of the whole scanned model
(the reference decoder, one CPU device, float32, no remat), on XLA:CPU's default emitters
unless XLA_FLAGS says otherwise: the loss and every param's grad, bits equal or the largest
difference. No files are read: the params come from memory, so only the program split is
measured.

    PYTHONPATH=. JAX_PLATFORMS=cpu python benchmarks/nvme_layerwise_parity.py [--layers 4] [--devices 8] [--json out.json]

`--devices N`: params split over N CPU devices along a dim N divides, rows too, laid out by
XLA's partitioner alone (not the project's sharding plan or its per-layer gathers).
"""

from __future__ import annotations

import argparse
import json
import sys

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import Block, Decoder, cross_entropy, embed_updates_layout
from fsdp_jax.sharding.precision import take


def _model(layers: int):
    cfg = DecoderConfig(
        vocab_size=256, d_model=64, n_layers=layers, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=64
    )
    return cfg, Decoder(cfg, rngs=nnx.Rngs(0), remat="none")


def scanned(graphdef, state, tokens):
    """(loss, grads) of the whole model, its layers scanned: the reference."""

    def loss(st):
        return cross_entropy(nnx.merge(graphdef, st)(tokens[:, :-1]), tokens[:, 1:])

    return jax.jit(jax.value_and_grad(loss))(state)


def layerwise(cfg, graphdef, state, tokens):
    """(loss, grads) from one program per piece: embedding, each layer (forward, then its vjp in
    reverse from the kept input), head; the layer programs compiled once, called per layer."""
    blocks = state["blocks"]
    block_def = nnx.split(nnx.eval_shape(lambda: Block(cfg, nnx.Rngs(0))))[0]
    rest = {k: v for k, v in state.items() if k != "blocks"}

    def embed(r):
        emb = r["embed"][...]
        return take(emb, tokens[:, :-1], lambda g: g, embed_updates_layout()).astype(emb.dtype)

    def layer(p, h):
        return nnx.merge(block_def, p)(h)

    def head(r, h):
        m = nnx.merge(graphdef, nnx.State({**r, "blocks": blocks}))
        return cross_entropy(m._head(h), tokens[:, 1:])

    layer_fwd = jax.jit(layer)
    layer_bwd = jax.jit(lambda p, h, ct: jax.vjp(layer, p, h)[1](ct))
    n = cfg.n_layers
    per_layer = [jax.tree.map(lambda x, i=i: x[i], blocks) for i in range(n)]
    h0, embed_vjp = jax.vjp(jax.jit(embed), rest)
    hs = [h0]
    for i in range(n):
        hs.append(layer_fwd(per_layer[i], hs[-1]))
    loss, (g_rest, ct) = jax.jit(jax.value_and_grad(head, argnums=(0, 1)))(rest, hs[-1])
    g_layers = [None] * n
    for i in reversed(range(n)):
        g_layers[i], ct = layer_bwd(per_layer[i], hs[i], ct)
    (g_embed,) = embed_vjp(ct)
    g_rest = jax.tree.map(jnp.add, g_rest, g_embed)
    g_blocks = jax.tree.map(lambda *xs: jnp.stack(xs), *g_layers)
    return loss, nnx.State({**g_rest, "blocks": g_blocks})


def _sharded(state, tokens, n: int):
    """`state` with each leaf split over n devices along its last dim that n divides (else
    whole), `tokens` over its rows: XLA's partitioner lays out both programs from these."""
    mesh = Mesh(np.array(jax.devices()[:n]), ("fsdp",))

    def put(x):
        dims = [d for d in range(x.ndim) if x.shape[d] % n == 0]
        spec = [None] * x.ndim
        if dims:
            spec[dims[-1]] = "fsdp"
        return jax.device_put(x, NamedSharding(mesh, P(*spec)))

    return jax.tree.map(put, state), jax.device_put(tokens, NamedSharding(mesh, P("fsdp", None)))


def compare(layers: int, batch: int, seq: int, seed: int, devices: int = 1) -> dict:
    cfg, model = _model(layers)
    graphdef, state = nnx.split(model)
    tokens = jax.random.randint(jax.random.key(seed), (batch, seq + 1), 0, cfg.vocab_size)
    if devices > 1:
        state, tokens = _sharded(state, tokens, devices)
    ref_loss, ref_g = scanned(graphdef, state, tokens)
    loss, g = layerwise(cfg, graphdef, state, tokens)
    rows = {}
    ref_flat = jax.tree_util.tree_flatten_with_path(ref_g)[0]
    for (path, a), b in zip(ref_flat, jax.tree.leaves(g)):
        a, b = np.asarray(a), np.asarray(b)
        rows[jax.tree_util.keystr(path)] = {
            "equal": bool(np.array_equal(a, b)),
            "max_abs": float(np.max(np.abs(a - b))),
            "max_rel": float(np.max(np.abs(a - b)) / max(float(np.max(np.abs(a))), 1e-30)),
        }
    return {
        "devices": devices,
        "layers": layers,
        "batch": batch,
        "seq": seq,
        "loss_ref": float(ref_loss),
        "loss_layerwise": float(loss),
        "loss_equal": bool(np.asarray(ref_loss) == np.asarray(loss)),
        "grads_equal": sum(r["equal"] for r in rows.values()),
        "grads": len(rows),
        "grad_max_rel": max(r["max_rel"] for r in rows.values()),
        "per_leaf": rows,
    }


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=32)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--devices", type=int, default=1, help="CPU devices to split params and rows over")
    ap.add_argument("--json", help="write the result here")
    args = ap.parse_args(argv)
    jax.config.update("jax_num_cpu_devices", args.devices)
    with nnx.use_eager_sharding(False):  # one device, no mesh: the logical names stay metadata
        r = compare(args.layers, args.batch, args.seq, args.seed, args.devices)
    print(
        f"loss scanned {r['loss_ref']!r} layer-wise {r['loss_layerwise']!r} equal={r['loss_equal']}; "
        f"grads equal {r['grads_equal']} of {r['grads']}, largest relative difference {r['grad_max_rel']:.3g}"
    )
    for k, v in r["per_leaf"].items():
        if not v["equal"]:
            print(f"  {k}: max abs {v['max_abs']:.3g}, rel {v['max_rel']:.3g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(r, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
