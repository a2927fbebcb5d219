"""Dropless MoE computes top_k / n_experts of the dense all-experts MLP where the compiler has
a grouped matmul: the decoder's MoE layer (router, sort, `ragged_dot`, un-sort) compiled for a
TPU target (deviceless, libtpu), forward and backward, against the same layer with every
token routed to every expert (top-k = n_experts: the dense form's FLOPs, through the same
code). XLA:CPU lowers `ragged_dot` densely (tests/test_moe.py: capacity mode is the CPU's
sparse path), and so does XLA:GPU at jax 0.10 (measured: a dense dot over all experts'
rows, docs/moe.md)."""

import os

import jax
import pytest

from helpers import json_child

# the MoE layer alone compiled for `dev`, forward and forward + backward (bf16, one device):
# each program's text and the op inventory's GEMMs; the two children below summarise them
_LAYER_GEMMS = r"""
import dataclasses, json
import jax, jax.numpy as jnp
from flax import nnx
from jax.sharding import SingleDeviceSharding
from fsdp_jax.app.models import moe as moe_lib
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.hlo.costs import op_inventory
from fsdp_jax.targets.compile_cache import compile_lowered

def layer_gemms(cfg, dev, n_tokens=2048):
    sh = SingleDeviceSharding(dev)
    with nnx.use_eager_sharding(False):
        graph, state = nnx.split(nnx.eval_shape(lambda: moe_lib.MoE(cfg, nnx.Rngs(0))))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=sh), state)
    x = jax.ShapeDtypeStruct((1, n_tokens, cfg.d_model), jnp.bfloat16, sharding=sh)
    def fwd_bwd(s, x):
        loss = lambda s, x: nnx.merge(graph, s)(x)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(s, x)
    out = {}
    for name, fn in (("forward", lambda s, x: nnx.merge(graph, s)(x)[0]), ("train", fwd_bwd)):
        with jax.default_device(dev):  # as the planner lowers for a target (StepBuild.compile)
            text = compile_lowered(jax.jit(fn).lower(state, x), [dev]).as_text()
        out[name] = (text, [o for o in op_inventory(text) if o["kind"] == "gemm"])
    return out

def layer_config(**kw):
    return DecoderConfig(vocab_size=64, d_model=512, n_layers=1, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32,
                       n_experts=8, experts_per_token=2, moe_ffn_dim=1024, norm_topk_prob=True, **kw)
"""

# XLA's cost analysis of the MoE layer (forward, and forward + backward) compiled for `dev`, bf16
_COST_FLOPS = r"""
def cost_flops(cfg, n_tokens=2048):
    sh = SingleDeviceSharding(dev)
    with nnx.use_eager_sharding(False):
        graph, state = nnx.split(nnx.eval_shape(lambda: moe_lib.MoE(cfg, nnx.Rngs(0))))
    state = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, jnp.bfloat16, sharding=sh), state)
    x = jax.ShapeDtypeStruct((1, n_tokens, cfg.d_model), jnp.bfloat16, sharding=sh)
    def fwd_bwd(s, x):
        loss = lambda s, x: nnx.merge(graph, s)(x)[0].astype(jnp.float32).sum()
        return jax.grad(loss, argnums=(0, 1))(s, x)
    out = {}
    for name, fn in (("forward", lambda s, x: nnx.merge(graph, s)(x)[0]), ("train", fwd_bwd)):
        ca = compile_lowered(jax.jit(fn).lower(state, x), [dev]).cost_analysis()
        out[name] = float((ca if isinstance(ca, dict) else ca[0])["flops"])
    return out
"""


_GPU_CHILD = (
    _LAYER_GEMMS
    + r"""
from fsdp_jax.targets import gpu as targets

dev = targets.gpu_devices("h100", 1, 1)[0]

def flops(cfg):
    out = {}
    for name, (text, ops) in layer_gemms(cfg, dev).items():
        out[name] = {"flops": sum(o["flops"] * o["runs"] for o in ops),
                     "grouped": sum(o["runs"] for o in ops if "groups" in o),
                     "kernels": sorted({t for t in ("__gpu$xla.gpu.triton", "mosaic_gpu") if t in text})}
    return out

base = layer_config(grouped_matmul="auto")
print(json.dumps({"sparse": flops(base), "dense": flops(dataclasses.replace(base, experts_per_token=8))}))
"""
)


@pytest.mark.slow
def test_dropless_moe_layer_on_gpu_runs_tokamax_grouped_gemms_at_top_k_over_n_experts_of_the_dense_flops():
    """On an H100 target `grouped_matmul: auto` picks tokamax's ragged_dot kernels (XLA:GPU's
    own ragged_dot is a dense dot over all experts there): the layer's GEMM FLOPs, read from
    the compiled program by `fsdp_jax.hlo.costs` (the kernels' FLOPs from their operand shapes,
    `fsdp_jax.hlo.grouped`; XLA's cost analysis counts custom calls as 0), are top_k /
    n_experts of the same layer with every token sent to every expert."""
    pytest.importorskip("tokamax")
    from fsdp_jax.targets import gpu as targets

    assert targets.plugin_installed(), "CUDA plugin missing: python -m fsdp_jax.targets install cuda"
    r = json_child(_GPU_CHILD, env=targets.child_env(dict(os.environ)))
    for kind, calls in (("forward", 3), ("train", 3 + 6)):  # gate, up, down; backward: dx and dw of each
        sparse, dense = r["sparse"][kind], r["dense"][kind]
        assert sparse["kernels"] and sparse["grouped"] == calls, (kind, sparse)
        assert sparse["flops"] <= 1.3 * (2 / 8) * dense["flops"], (kind, sparse, dense)
        assert sparse["flops"] >= (2 / 8) * dense["flops"] * 0.9, (kind, sparse, dense)


_TPU_CHILD = (
    _LAYER_GEMMS
    + _COST_FLOPS
    + r"""
from jax.experimental import topologies

dev = sorted(topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices, key=lambda d: d.id)[0]

def gemms(impl):
    out = {}
    for name, (text, ops) in layer_gemms(layer_config(grouped_matmul=impl), dev).items():
        out[name] = {"flops": sum(o["flops"] * o["runs"] for o in ops),
                     "grouped": sum(o["runs"] for o in ops if "groups" in o),
                     "tokamax": text.count("PallasMosaicTpuRaggedDot") > 0,
                     "largest_other": max([o["flops"] for o in ops if "groups" not in o] or [0])}
    return out

base = layer_config(grouped_matmul="xla")
print(json.dumps({"sparse": cost_flops(base), "dense": cost_flops(dataclasses.replace(base, experts_per_token=8)),
                  "auto": gemms("auto"), "xla": gemms("xla")}))
"""
)


@pytest.fixture(scope="module")
def v5p_layer():
    """The TPU child's document (one child for the module's two v5p tests: one Python, JAX and
    libtpu start-up, the same programs as their two children compiled): "sparse" / "dense", XLA's
    cost analysis of the layer under XLA's `ragged_dot` at top-2 and at top-8; "auto" / "xla", the
    op inventory's GEMMs of the layer under tokamax's kernels and under XLA's `ragged_dot`."""
    from fsdp_jax.targets import gpu as targets

    assert targets.plugin_installed(kind="tpu"), "libtpu missing: python -m fsdp_jax.targets install tpu"
    env = targets.child_env(dict(os.environ), target=targets.make_target("v5p", devices=4))
    return json_child(_TPU_CHILD, env=env)


@pytest.mark.slow
def test_dropless_moe_layer_compiles_to_top_k_over_n_experts_of_the_dense_flops_on_tpu(v5p_layer):
    """XLA's own `ragged_dot` (`grouped_matmul: xla`; `auto` runs tokamax's kernels on TPU, whose
    FLOPs XLA's cost analysis does not see: the last test of this file)."""
    r = v5p_layer
    for kind in ("forward", "train"):
        sparse, dense = r["sparse"][kind], r["dense"][kind]
        # top-2 of 8: a quarter of the experts' FLOPs; the router and the sort are the rest
        assert sparse <= 1.3 * (2 / 8) * dense, (kind, sparse, dense)
        assert sparse >= (2 / 8) * dense * 0.9, (kind, sparse, dense)  # the experts are computed


@pytest.mark.slow
def test_dropless_moe_layer_on_tpu_runs_tokamax_kernels_with_grouped_weight_gradients(v5p_layer):
    """On a v5p target `grouped_matmul: auto` picks tokamax's Mosaic TPU kernels (megablox
    gmm / tgmm), whose weight gradients are grouped: the layer's GEMM FLOPs forward and
    forward + backward, read from the compiled program by the op inventory (the kernels from
    their operand shapes), are top_k / n_experts of the dense einsum over all experts, where
    XLA's own `ragged_dot` computes each weight gradient over all 8 experts' rows."""
    pytest.importorskip("tokamax")
    r = v5p_layer
    n, d, f, e = 2048, 512, 1024, 8
    dense_fwd = 3 * 2 * n * d * f * e  # gate, up, down of every token through every expert
    for kind, calls, dense in (("forward", 3, dense_fwd), ("train", 3 + 6, 3 * dense_fwd)):
        got = r["auto"][kind]
        assert got["tokamax"] and got["grouped"] == calls, (kind, got)
        assert (2 / 8) * dense <= got["flops"] <= 1.3 * (2 / 8) * dense, (kind, got, dense)
        # no dense product of the experts' size outside the kernels (the router's is 2 n d e)
        assert got["largest_other"] <= 2 * n * d * e, (kind, got)
    # XLA's ragged_dot on the same target: grouped forward; weight gradients over all experts on jax
    # 0.10.2's XLA:TPU, grouped as tokamax's from jax 0.12.0.1's (its train FLOPs equal the kernels',
    # read 2026-12-08 in CI lane 2's venv with libtpu installed)
    if jax.__version_info__ < (0, 12):
        assert r["xla"]["train"]["flops"] > 2.5 * r["auto"]["train"]["flops"], r
    else:
        assert (2 / 8) * 3 * dense_fwd <= r["xla"]["train"]["flops"] <= 1.3 * (2 / 8) * 3 * dense_fwd, r
    assert r["xla"]["forward"]["flops"] <= 1.3 * (2 / 8) * dense_fwd, r
