"""Splash attention per ring block (`fsdp_jax.attention.splash_block`): the Pallas kernel's
forward with its log-sum-exp and its private backward given the ring's global o and lse,
inside the flash ring's custom VJP. On CPU the kernel runs interpreted (`interpret=True`)
against one device's dense attention (float32, context 2 and 4, packed rows, soft caps);
for TPU targets the ring compiles deviceless (libtpu) with splash kernels in it and no
score block of the ring's size in float32."""

import inspect
import json
import os
import re

import jax.numpy as jnp
import pytest
from test_ring_flash import compiled_ring, dense_value_and_grad, inputs, ring_value_and_grad

from fsdp_jax.attention.splash_block import splash_kernel
from fsdp_jax.targets import gpu as targets
from helpers import json_child

SPLASH = {
    "causal": dict(),
    "packed": dict(packed=True),
    "packed_softcap": dict(packed=True, cap=3.0),
}
# causal and packed rows differ in data only (segment ids, positions): one compiled ring checks both
PROGRAMS = {"no_cap": ("causal", "packed"), "softcap": ("packed_softcap",)}


@pytest.mark.slow
@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("program", PROGRAMS)
def test_interpreted_splash_ring_matches_one_device(program, n):
    """Half blocks of 128 tokens (splash's backward wants key blocks of 128 lanes): rows of
    256 x context, 2 query heads on one kv head (the multi-query form), head dim 128."""
    compiled = None
    for case in PROGRAMS[program]:
        c = SPLASH[case]
        args = inputs(c, b=8 // n, s=256 * n, h=2, dh=128)
        kern = splash_kernel(scale=128**-0.5, softcap=c.get("cap", 0.0), interpret=True, block=128)
        kv_pass = "ring" if n == 2 else "all_gather"
        compiled = compiled or compiled_ring(c, kern, n, kv_pass, args)
        out, g, _ = ring_value_and_grad(c, kern, n, kv_pass, args, compiled=compiled)
        ref, ref_g = dense_value_and_grad(c, args)
        assert abs(float(out - ref)) <= 1e-5 * abs(float(ref)), (case, out, ref)
        for name, a, r in zip("qkv", g, ref_g):
            err = float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r)))
            assert err <= 1e-5, (case, name, err)


def test_the_private_backward_keeps_the_signature_the_ring_calls():
    """`_splash_attention_bwd(save_residuals, mask_value, is_mqa, block_sizes,
    residual_checkpoint_name, mask_function, attn_logits_soft_cap, interpret, res, do)` and
    the forward's residual order, as jax 0.10 has them (ring_splash.py calls both)."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as sk

    params = list(inspect.signature(sk._splash_attention_bwd).parameters)
    assert params == [
        "save_residuals", "mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name",
        "mask_function", "attn_logits_soft_cap", "interpret", "res", "do",
    ]  # fmt: skip
    kernel_params = list(inspect.signature(sk.SplashAttentionKernel.__init__).parameters)
    assert kernel_params == ["self", "fwd_mask_info", "dq_mask_info", "dkv_mask_info", "kwargs"]
    custom = list(inspect.signature(sk._splash_attention_custom).parameters)
    assert custom[-8:] == [
        "save_residuals", "mask_value", "is_mqa", "block_sizes", "residual_checkpoint_name",
        "mask_function", "attn_logits_soft_cap", "interpret",
    ]  # fmt: skip  # the kwargs ring_splash gives SplashAttentionKernel
    src = inspect.getsource(sk._splash_attention_bwd)
    assert re.search(r"q,\s*k,\s*v,\s*segment_ids,\s*sinks,\s*o,\s*logsumexp,\s*dq_mask_info,\s*dkv_mask_info", src)


_TPU_CHILD = """
import json, re, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import fsdp_jax as fj
from fsdp_jax.targets import gpu as targets
from fsdp_jax.attention.flash import flash_context_attention
from fsdp_jax.attention.splash_block import splash_kernel

def compile_ring(req):
    devices = targets.target_devices(targets.Target(**req["target"]))
    n, s, h, kvh, dh = req["context"], req["seq"], req["heads"], req["kv_heads"], 128
    mesh = fj.make_mesh(fsdp=len(devices) // n, context=n, devices=devices)
    kern = splash_kernel(scale=dh**-0.5, softcap=req["softcap"], window=req.get("window", 0))

    def loss(q, k, v, pos, seg):
        o = flash_context_attention(q, k, v, pos, seg, kernel=kern, kv_pass=req["kv_pass"])
        return jnp.sum(o.astype(jnp.float32) ** 2)

    sh = NamedSharding(mesh, P("fsdp", "context"))
    b = len(devices) // n
    qa = jax.ShapeDtypeStruct((b, s, h, dh), jnp.bfloat16, sharding=sh)
    ka = jax.ShapeDtypeStruct((b, s, kvh, dh), jnp.bfloat16, sharding=sh)
    ia = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sh)
    with jax.set_mesh(mesh):
        c = jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qa, ka, ka, ia, ia).compile()
    hlo = c.as_text()
    half = s // n // 2
    big = [m for m in re.findall(r"f32\\[([\\d,]+)\\]", hlo) if sum(int(d) >= half for d in m.split(",")) >= 2]
    return {"temp": c.memory_analysis().temp_size_in_bytes, "big_f32": sorted(set(big)),
            "kernels": sorted(set(re.findall(r"splash_\\w*?_(fwd|dq|dkv)", hlo))),
            "calls": len(re.findall(r'custom_call_target="tpu_custom_call"', hlo)),
            "collectives": sorted(set(re.findall(r"\\b(all-gather|reduce-scatter|all-reduce|collective-permute"
                                                 r"|all-to-all)(?:-start)?\\(", hlo)))}

print(json.dumps([compile_ring(req) for req in json.loads(sys.argv[1])]))
"""
# The two v6e rings below (all-gather K/V; a window with ring K/V), one request each
TPU_RINGS = {
    "all_gather": dict(kv_pass="all_gather", softcap=30.0),
    "window": dict(kv_pass="ring", window=1536, softcap=0.0),
}


@pytest.fixture(scope="module")
def tpu_rings():
    """{name: compiled ring's facts} of TPU_RINGS, compiled deviceless in one child process (one
    Python, JAX and libtpu start-up for both)."""
    assert targets.plugin_installed(kind="tpu"), "libtpu missing: python -m fsdp_jax.targets install tpu"
    t = targets.make_target("v6e", devices=4)
    req = {"target": t.as_dict(), "context": 2, "seq": 4096, "heads": 4, "kv_heads": 1}
    reqs = [dict(req, **TPU_RINGS[name]) for name in TPU_RINGS]
    got = json_child(_TPU_CHILD, json.dumps(reqs), env=targets.child_env(dict(os.environ), target=t))
    return dict(zip(TPU_RINGS, got))


@pytest.mark.slow
def test_splash_ring_compiles_for_tpu_without_score_blocks(tpu_rings):
    """v6e, 2 x 2 chips as fsdp 2 x context 2, rows of 4096 (half blocks of 1024 tokens),
    4 query heads on one kv head, soft caps, all-gather K/V: splash's forward, dq and dkv
    kernels are in the compiled step and no float32 tensor has two dims of a half block's
    length or more (the XLA ring's (2048 x 1024) score blocks would be)."""
    got = tpu_rings["all_gather"]
    assert got["kernels"] == ["dkv", "dq", "fwd"], got
    assert got["big_f32"] == [], got
    assert "all-gather" in got["collectives"], got  # K/V gathered over context


@pytest.mark.slow
def test_windowed_splash_ring_compiles_for_tpu_without_score_blocks(tpu_rings):
    """The same v6e ring (chunks of 1024) with a sliding window of 1536 (across a chunk) and
    packed rows' segment ids: one forward, dq and dkv kernel per band of the plan
    (`ring_window`: 6 at context 2), every one of them in the compiled step, and no
    float32 tensor with two dims of a chunk's length."""
    from fsdp_jax.attention.windows import plan_summary, window_plan

    got = tpu_rings["window"]
    bands = plan_summary(window_plan(n=2, c=1024, window=1536, pattern=False))["calls"]
    assert got["kernels"] == ["dkv", "dq", "fwd"], got
    assert got["calls"] == 3 * bands, (bands, got)
    assert got["big_f32"] == [], got


@pytest.mark.slow
@pytest.mark.parametrize("family", [{}, {"sliding_window": 200, "global_every": 2, "rope_local_theta": 100.0}])
def test_the_trainers_decoder_with_splash_per_ring_block_equals_one_device(monkeypatch, family):
    """`model.attention: splash` at context 2 through the trainer's decoder and loss (zig-zag
    batch, RoPE positions, packed rows' segment ids, GQA, soft caps; and Gemma's pattern: a
    sliding window of 200 across a 128-token chunk on layer 1, global layer 2), the kernel
    interpreted on CPU: loss, grad norm and params after 2 SGD steps equal one device's XLA
    attention (f32)."""
    import dataclasses

    import numpy as np
    from test_context_parallel import reference, rel, train

    from fsdp_jax.app.data.packing import batch_from_rows, pack
    from fsdp_jax.app.models.config import DecoderConfig
    from fsdp_jax.attention.flash import RING_KERNELS

    made = []

    def interpreted(**kw):
        made.append(kw)
        return splash_kernel(**kw, interpret=True, block=128)

    monkeypatch.setitem(RING_KERNELS, "splash", interpreted)
    seq = 512  # half blocks of 128 at context 2
    cfg = DecoderConfig(
        vocab_size=128, d_model=256, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=256, max_seq_len=seq,
        rope_theta=500.0, attn_softcap=20.0, **family,
    )  # fmt: skip
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(2):
        examples = []
        while sum(len(t) for t, _ in examples) < 4 * seq * 0.9:
            n_tok = int(rng.integers(20, 300))
            examples.append((rng.integers(0, 128, n_tok), np.ones(n_tok, np.uint8)))
        tok, msk, seg = pack(examples, seq)
        batches.append({k: jnp.asarray(v) for k, v in batch_from_rows(tok[:4], msk[:4], seg[:4]).items()})
    ref_params, ref_losses, ref_norm = reference(cfg, batches)  # one device, attention xla
    _, state, losses, norms = train(
        dataclasses.replace(cfg, attention="splash"), dict(fsdp=4, context=2), "full_shard", batches
    )
    assert made and made[0]["softcap"] == 20.0, made  # the decoder's layers ran the splash ring
    np.testing.assert_allclose(losses, ref_losses, rtol=1e-5)
    np.testing.assert_allclose(norms[0], ref_norm, rtol=1e-5)
    assert rel(state.params, ref_params) <= 1e-5
