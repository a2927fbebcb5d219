"""Dropless MoE computes top_k / n_experts of the dense all-experts MLP where the compiler has
a grouped matmul: the decoder's MoE layer (router, sort, `ragged_dot`, un-sort) compiled for a
TPU target (deviceless, libtpu), forward and backward, against the same layer with every
token routed to every expert (top-k = n_experts: the dense form's FLOPs, through the same
code). XLA:CPU lowers `ragged_dot` densely (tests/test_moe.py: capacity mode is the CPU's
sparse path), and so does XLA:GPU at jax 0.10 (measured: a dense dot over all experts'
rows, docs/moe.md)."""

import os

import pytest

from helpers import json_child

_CHILD = r"""
import dataclasses, json, sys
import jax, jax.numpy as jnp
from flax import nnx
from jax.experimental import topologies
from jax.sharding import SingleDeviceSharding
from fsdp_jax.app.models import moe as moe_lib
from fsdp_jax.app.models.config import LlamaConfig

dev = sorted(topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices, key=lambda d: d.id)[0]
sh = SingleDeviceSharding(dev)
base = LlamaConfig(vocab_size=64, d_model=512, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                   n_experts=8, experts_per_token=2, moe_ffn_dim=1024, norm_topk_prob=True)

def flops(cfg, n_tokens=2048):
    with nnx.use_eager_sharding(False):
        graph, state = nnx.split(nnx.eval_shape(lambda: moe_lib.MoE(cfg, nnx.Rngs(0))))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=sh), state)
    x = jax.ShapeDtypeStruct((1, n_tokens, cfg.d_model), jnp.bfloat16, sharding=sh)
    def fwd_bwd(s, x):
        loss = lambda s, x: nnx.merge(graph, s)(x)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(s, x)
    out = {}
    for name, fn in (("forward", lambda s, x: nnx.merge(graph, s)(x)[0]), ("train", fwd_bwd)):
        ca = jax.jit(fn).lower(state, x).compile().cost_analysis()
        out[name] = float((ca if isinstance(ca, dict) else ca[0])["flops"])
    return out

print(json.dumps({"sparse": flops(base), "dense": flops(dataclasses.replace(base, experts_per_token=8))}))
"""


@pytest.mark.slow
def test_dropless_moe_layer_compiles_to_top_k_over_n_experts_of_the_dense_flops_on_tpu():
    from fsdp_jax.targets import gpu as targets

    assert targets.plugin_installed(kind="tpu"), "libtpu missing: python -m fsdp_jax.targets install tpu"
    env = targets.child_env(dict(os.environ), target=targets.make_target("v5p", devices=4))
    r = json_child(_CHILD, env=env)
    for kind in ("forward", "train"):
        sparse, dense = r["sparse"][kind], r["dense"][kind]
        # top-2 of 8: a quarter of the experts' FLOPs; the router and the sort are the rest
        assert sparse <= 1.3 * (2 / 8) * dense, (kind, sparse, dense)
        assert sparse >= (2 / 8) * dense * 0.9, (kind, sparse, dense)  # the experts are computed
