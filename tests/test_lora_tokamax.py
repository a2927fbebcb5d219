"""LoRA on the experts through tokamax's grouped kernels (`model.grouped_matmul: auto`): the
train step of a small MoE decoder with all-linear adapters (attention and every expert),
compiled deviceless for 8 x H100 and for TPU v5p. Every expert product, the frozen experts'
and the adapters' (rank r: x A (D -> r), then (x A) B), forward and backward, is a tokamax
kernel call; no dot runs over all experts' rows (XLA's dense lowering of `ragged_dot` on GPU,
its weight gradient on TPU), and nothing computes a frozen expert tensor's gradient."""

import os

import pytest

from helpers import json_child

_CHILD = r"""
import json, sys
import jax, jax.numpy as jnp, optax
from jax.sharding import NamedSharding, PartitionSpec as P
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.trainer.build import lora_optimizer, make_loss_fn, trainer_model
from fsdp_jax.hlo.costs import op_inventory
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.targets.compile_cache import compile_lowered
from fsdp_jax.train.build import build

target, rank = sys.argv[1], int(sys.argv[2])
if target == "h100":
    from fsdp_jax.targets import gpu as targets
    devs = targets.gpu_devices("h100", 1, 1)
else:
    from jax.experimental import topologies
    devs = sorted(topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices, key=lambda d: d.id)[:1]
cfg = DecoderConfig(vocab_size=384, d_model=512, n_layers=2, n_heads=8, n_kv_heads=2, ffn_dim=512, max_seq_len=512,
                  n_experts=6, experts_per_token=2, moe_ffn_dim=1024, norm_topk_prob=True, router_aux_loss_coef=0.02)
model = trainer_model(cfg, "none", lora_lib.LoraSpec(rank=rank, alpha=2.0 * rank, targets=lora_lib.WEIGHTS))
mesh = make_mesh(1, 1, 1, devices=devs)
built = build(model, lora_optimizer(optax.sgd(0.1)), mesh, "full_shard", loss_fn=make_loss_fn(model, cfg), has_aux=True,
              trainable=lora_lib.adapter_mask, min_shard_size=0, max_replicated_fraction=None,
              precision=Policy.parse("params=float32,compute=bfloat16"))
batch = jax.ShapeDtypeStruct((4, 513), jnp.int32, sharding=NamedSharding(mesh, P()))  # 2048 tokens
with jax.default_device(devs[0]):  # as the planner lowers for a target (StepBuild.compile)
    text = compile_lowered(built.train_step.lower(built.abstract_state, batch), devs).as_text()
ops = [o for o in op_inventory(text) if o["kind"] == "gemm"]
grouped = [o for o in ops if "groups" in o]
FROZEN_SHAPES = %r
print(json.dumps({
    # XLA:TPU's own ragged-dot kernel, not tokamax's (whose op_name names tokamax, or on
    # jax 0.12's GPU its Mosaic kernel: ragged_dot_sm90)
    "grouped": [[o["m"], o["n"], o["k"], o["batch"], o["runs"], "ragged-dot-" not in o["op_name"]] for o in grouped],
    "other": [[o["m"], o["n"], o["k"], o["batch"]] for o in ops if "groups" not in o],
    "kernels": sorted(t for t in ("mosaic_gpu", "__gpu$xla.gpu.triton", "PallasMosaicTpuRaggedDot") if t in text),
    "frozen_shaped": [l.strip()[:400] for l in text.splitlines()
                      if any(f"[{s}]" in l.split("=", 1)[-1][:40] for s in FROZEN_SHAPES)],
}))
"""
FROZEN_SHAPES = ("6,512,1024", "6,1024,512", "2,6,512,1024", "2,6,1024,512")  # the experts' (E, in, out), stacked
# what computes or reduces a tensor: a matmul, a collective, or a kernel call (tokamax's weight
# gradient, tgmm, is a custom call: the filter without it let a frozen expert's gradient through)
GRAD_OPS = (" dot(", " convolution(", " reduce-scatter(", " all-reduce(", " custom-call(")


def frozen_grads(shaped: list[str]) -> list[str]:
    """The lines of `shaped` (instructions whose result has a frozen expert tensor's shape)
    that compute or reduce it: a frozen tensor's gradient."""
    return [ln for ln in shaped if any(op in ln for op in GRAD_OPS)]


def test_the_frozen_gradient_filter_sees_a_kernel_call():
    """A frozen expert's weight gradient from tokamax's grouped kernel (a custom call with the
    experts' shape) is caught; the frozen weights' bf16 copy (a convert fusion) is not one."""
    tgmm = '%tgmm = bf16[6,512,1024]{2,1,0} custom-call(%x, %dy, %sizes), custom_call_target="mosaic_gpu"'
    cast = "%convert.3 = bf16[6,512,1024]{2,1,0} fusion(%p), kind=kLoop, calls=%fused_convert"
    assert frozen_grads([tgmm, cast]) == [tgmm]


def _compiled(kind: str, rank: int) -> dict:
    pytest.importorskip("tokamax")
    from fsdp_jax.targets import gpu as targets

    if kind == "h100":
        assert targets.plugin_installed(), "CUDA plugin missing: python -m fsdp_jax.targets install cuda"
        env = targets.child_env(dict(os.environ))
    else:
        assert targets.plugin_installed(kind="tpu"), "libtpu missing: python -m fsdp_jax.targets install tpu"
        env = targets.child_env(dict(os.environ), target=targets.make_target("v5p", devices=4))
    return json_child(_CHILD % (FROZEN_SHAPES,), kind, str(rank), env=env)


@pytest.mark.slow
@pytest.mark.parametrize("kind, rank", [("h100", 32), ("v5p", 128)])
def test_expert_adapters_run_through_tokamax_kernels_and_no_dot_spans_all_experts(kind, rank):
    """H100 at rank 32 (the adapters' thin products on tokamax's Triton kernel, the experts' on
    Mosaic GPU); v5p at rank 128, the smallest its Mosaic TPU kernel takes (a smaller rank's
    adapters stay on XLA's `ragged_dot` under `auto`: tests/test_grouped_matmul.py)."""
    r = _compiled(kind, rank)
    layers, e, d, f = 2, 6, 512, 1024
    # per layer: forward 3 expert products + 2 per adapter (gate_up, down); backward the frozen
    # experts' input gradients (3) and each adapter product's input and weight gradients (8)
    assert sum(g[4] for g in r["grouped"]) == layers * (3 + 4 + 3 + 8), r["grouped"]
    assert all(g[5] for g in r["grouped"]), "every grouped product is a tokamax kernel"
    with_rank = sum(g[4] for g in r["grouped"] if rank in g[:3])
    assert with_rank == layers * (4 + 8), r["grouped"]  # every adapter product, forward and backward
    assert r["kernels"], r
    # no dense product over all experts (XLA:GPU's lowering of ragged_dot contracts (rows, E x
    # in) with (E x in, out); a dense weight gradient batches the E experts)
    spans = {e * s for s in (d, f, rank)}
    wide = [o for o in r["other"] if o[3] == e or o[2] in spans]
    assert wide == [], wide
    assert frozen_grads(r["frozen_shaped"]) == [], r["frozen_shaped"]
