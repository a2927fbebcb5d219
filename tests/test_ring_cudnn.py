"""cuDNN flash attention per ring block (`fsdp_jax.attention.cudnn`) on GPU targets: the
ring compiles deviceless for 8 x H100 (XLA:GPU, the CUDA plugin and NVIDIA's cuDNN wheel from
`python -m fsdp_jax.targets install`) with cuDNN's forward and backward custom calls in it and
no float32 score block, with and without packed rows (cuDNN's packed layout per block); the
private primitives' operands and the packed conventions as jax 0.10 has them; and what the
kernel refuses (soft caps; segment ids without `packed`) in one line."""

import inspect
import json
import os
import re

import jax.numpy as jnp
import pytest

from fsdp_jax.attention.cudnn import cudnn_kernel
from fsdp_jax.attention.flash import flash_context_attention
from fsdp_jax.targets import gpu as targets
from fsdp_jax.targets.plugins import cudnn_installed
from helpers import json_child

# The child compiles every request of argv[1] (a JSON list) and prints one result per request.
_GPU_CHILD = """
import json, re, sys
import jax, jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import fsdp_jax as fj
from fsdp_jax.targets import gpu as targets
from fsdp_jax.targets.compile_cache import compile_lowered
from fsdp_jax.attention.ring import context_attention
from fsdp_jax.attention.flash import flash_context_attention
from fsdp_jax.attention.cudnn import cudnn_kernel
devices = targets.gpu_devices("h100")


def compiled(req):
    n, s, h, kvh, dh = req["context"], req["seq"], req["heads"], req["kv_heads"], 128
    mesh = fj.make_mesh(fsdp=len(devices) // n, context=n, devices=devices)
    b = len(devices) // n

    def loss(q, k, v, pos, seg):
        seg = seg if req.get("packed") else None
        w = req.get("window", 0)
        if req["impl"] == "cudnn":
            kern = cudnn_kernel(scale=dh**-0.5, packed=seg is not None, window=w)
            o = flash_context_attention(q, k, v, pos, seg, kernel=kern, kv_pass=req["kv_pass"])
        else:
            o = context_attention(q, k, v, pos, seg, scale=dh**-0.5, window=w, kv_pass=req["kv_pass"])
        return jnp.sum(o.astype(jnp.float32) ** 2)

    sh = NamedSharding(mesh, P("fsdp", "context"))
    qa = jax.ShapeDtypeStruct((b, s, h, dh), jnp.bfloat16, sharding=sh)
    ka = jax.ShapeDtypeStruct((b, s, kvh, dh), jnp.bfloat16, sharding=sh)
    ia = jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=sh)
    with jax.set_mesh(mesh):
        c = compile_lowered(jax.jit(jax.grad(loss, argnums=(0, 1, 2))).lower(qa, ka, ka, ia, ia), devices)
    hlo = c.as_text()
    half = s // n // 2
    big = [m for m in re.findall(r"f32\\[([\\d,]+)\\]", hlo) if sum(int(d) >= half for d in m.split(",")) >= 2]
    calls = re.findall(r'custom_call_target="(__cudnn\\$fmha\\w*)"', hlo)
    return {"temp": c.memory_analysis().temp_size_in_bytes, "big_f32": sorted(set(big)),
            "calls": {t: calls.count(t) for t in sorted(set(calls))},
            "collectives": sorted(set(re.findall(r"\\b(all-gather|reduce-scatter|all-reduce|collective-permute"
                                                 r"|all-to-all)(?:-start)?\\(", hlo)))}


print(json.dumps([compiled(req) for req in json.loads(sys.argv[1])]))
"""


def _request(impl, kv_pass, context=4, packed=False, window=0):
    return {
        "impl": impl,
        "kv_pass": kv_pass,
        "context": context,
        "seq": 8192,
        "heads": 8,
        "kv_heads": 2,
        "packed": packed,
        "window": window,
    }


# every compile the module's tests read, in one child (one Python and plugin start-up, not 15)
REQUESTS = [_request("cudnn", kv) for kv in ("ring", "all_gather")] + [_request("xla", "ring")]
REQUESTS += [_request(impl, kv, packed=True) for impl in ("cudnn", "xla") for kv in ("ring", "all_gather")]
REQUESTS += [
    _request(impl, "ring", packed=packed, window=window)
    for impl in ("cudnn", "xla")
    for packed in (False, True)
    for window in (512, 1536)
]


@pytest.fixture(scope="module")
def compiled():
    """`compiled(impl, kv_pass, ...)`: the child's result for that request of REQUESTS."""
    assert cudnn_installed(), (
        f"NVIDIA's cuDNN wheel is not in {targets.plugin_dir()}: python -m fsdp_jax.targets install"
    )
    results = json_child(_GPU_CHILD, json.dumps(REQUESTS), env=targets.child_env(dict(os.environ)))
    by_request = {json.dumps(r, sort_keys=True): got for r, got in zip(REQUESTS, results, strict=True)}
    return lambda *a, **kw: by_request[json.dumps(_request(*a, **kw), sort_keys=True)]


@pytest.mark.slow
@pytest.mark.parametrize("kv_pass", ["ring", "all_gather"])
def test_cudnn_ring_compiles_for_h100_with_cudnn_blocks_and_no_score_block(kv_pass, compiled):
    """fsdp 2 x context 4 on 8 x H100, rows of 8192 (2048 per rank, half blocks of 1024), 8 query
    heads on 2 kv heads, bf16: one cuDNN forward for the rank's own block and one per branch of
    each later step's lax.cond (1 + 2 x 3), the same backward calls, no float32 tensor with two
    dims of a half block's length or more; the XLA ring at the same shape has them."""
    got = compiled("cudnn", kv_pass)
    assert got["calls"] == {"__cudnn$fmhaSoftmax": 7, "__cudnn$fmhaSoftmaxBackward": 7}, got
    assert got["big_f32"] == [], got
    ring_ops = {"collective-permute"} if kv_pass == "ring" else {"all-gather"}
    assert ring_ops <= set(got["collectives"]), got
    if kv_pass == "ring":
        xla = compiled("xla", kv_pass)
        assert xla["big_f32"] and not xla["calls"], xla
        assert got["temp"] < xla["temp"] / 2, (got["temp"], xla["temp"])


@pytest.mark.slow
@pytest.mark.parametrize("kv_pass", ["ring", "all_gather"])
def test_packed_cudnn_ring_compiles_for_h100_with_cudnn_blocks_and_no_score_block(kv_pass, compiled):
    """The same ring with packed rows' segment ids (cudnn_kernel(packed=True): each block in
    cuDNN's packed layout): the same 7 + 7 cuDNN calls in the ring, no float32 tensor with two
    dims of a half block's length (the packed stats are (B x 128 segments, H, Sq)), under half
    the XLA ring's temporaries with the same segment ids."""
    got = compiled("cudnn", kv_pass, packed=True)
    assert got["calls"] == {"__cudnn$fmhaSoftmax": 7, "__cudnn$fmhaSoftmaxBackward": 7}, got
    assert got["big_f32"] == [], got
    xla = compiled("xla", kv_pass, packed=True)
    assert xla["big_f32"] and not xla["calls"], xla
    assert got["temp"] < xla["temp"] / 2, (got["temp"], xla["temp"])


def _window_calls(context, seq, window, packed):
    """cuDNN forward calls the windowed ring traces (as many backward): every band of every
    chunk pair's branches as `band_pieces`, a reversed square of packed rows as two calls."""
    from fsdp_jax.attention.cudnn_bands import band_pieces
    from fsdp_jax.attention.windows import window_plan

    c = seq // context // 2
    plan = window_plan(n=context, c=c, window=window, pattern=False)
    pieces = [kind for pp in plan.values() for band in pp.bands for _, _, kind in band_pieces(band, c, c)]
    return sum(2 if packed and kind == "anti" else 1 for kind in pieces)


@pytest.mark.slow
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("window", [512, 1536])
def test_windowed_cudnn_ring_compiles_for_h100_with_cudnn_blocks_and_no_score_block(window, packed, compiled):
    """The same ring (fsdp 2 x context 4, chunks of 1024) with Mistral-style sliding windows,
    shorter than a chunk (512) and across one (1536), with and without packed rows: every band
    of the plan is cuDNN calls in the compiled step (the count the plan and `band_pieces` give,
    forward and backward), no float32 tensor with two dims of a chunk's length, and under half
    the XLA ring's temporaries with the same window."""
    got = compiled("cudnn", "ring", packed=packed, window=window)
    n = _window_calls(4, 8192, window, packed)
    assert got["calls"] == {"__cudnn$fmhaSoftmax": n, "__cudnn$fmhaSoftmaxBackward": n}, (n, got)
    assert got["big_f32"] == [], got
    xla = compiled("xla", "ring", packed=packed, window=window)
    assert xla["big_f32"] and not xla["calls"], xla
    assert got["temp"] < xla["temp"] / 2, (got["temp"], xla["temp"])


def test_the_private_backward_takes_the_operands_the_ring_gives():
    from jax._src.cudnn import fused_attention_stablehlo as fa

    src = inspect.getsource(fa._dot_product_attention_bwd_impl)
    names = re.search(r"def _dot_product_attention_bwd_impl\(([^)]*)\)", src).group(1).split(",")
    assert [x.strip() for x in names][:13] == [
        "query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
        "page_table_k", "page_table_v", "activation", "fwd_output", "grad_output",
    ]  # fmt: skip
    src = inspect.getsource(fa._dot_product_attention_fwd_impl)  # the packed kernel binds the forward too
    names = re.search(r"def _dot_product_attention_fwd_impl\(([^)]*)\)", src).group(1).split(",")
    assert [x.strip() for x in names][:10] == [
        "query", "key", "value", "bias", "q_seqlen", "kv_seqlen", "q_offsets", "kv_offsets",
        "page_table_k", "page_table_v",
    ]  # fmt: skip
    # the last params: jax 0.10 ends with is_training; jax 0.12 with score_mod, is_training (flex
    # attention: ring_cudnn passes score_mod=None there and no score_mod_args operands)
    tail = [x.strip() for x in names][10:]
    assert tail in (
        ["scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout", "sliding_window_length", "is_training"],
        ["score_mod_args", "scale", "seed", "dropout_rate", "variadic_args", "mask_type", "layout",
         "sliding_window_length", "score_mod", "is_training"],
    ), tail  # fmt: skip
    assert {"PADDING", "PADDING_CAUSAL"} <= set(fa.MaskType.__members__)
    # packed: stats (B x M, N, T); both sides' offsets scaled by q's heads (K/V repeated to them)
    assert "softmax_stat_shape = (B * max_seg_per_batch, N, T)" in inspect.getsource(
        fa._dot_product_attention_fwd_abstract
    )
    fix = inspect.getsource(fa._fix_seqlen_offsets)
    # jax 0.10 scales kv offsets by q's heads (K/V must be repeated to them); jax 0.12 by K's own
    # (N_kv from key.shape): with the repeated K/V, N_kv == N there, so the same call is right on both
    assert "B, T, N, H = query.shape" in fix
    assert "kv_offsets = kv_offsets * N * H" in fix or (
        "kv_offsets = kv_offsets * N_kv * H" in fix and "_, S, N_kv, _ = key.shape" in fix
    )
    params = inspect.signature(fa.dot_product_attention).parameters
    assert "return_residual" in params and fa.AttentionLayout.BTNH.value == 0
    assert {"CAUSAL", "NO_MASK"} <= set(fa.MaskType.__members__)


def test_what_cudnn_per_block_refuses():
    for kw in (dict(softcap=3.0), dict(softcap=3.0, window=8, packed=True)):
        with pytest.raises(ValueError, match="soft cap"):
            cudnn_kernel(scale=1.0, **kw)
    assert cudnn_kernel(scale=1.0, window=8).window == 8  # windows: the ring's bands (test_ring_window)
    q = jnp.zeros((2, 8, 2, 8), jnp.bfloat16)
    ids = jnp.zeros((2, 8), jnp.int32)
    with pytest.raises(ValueError, match="segment ids"):
        flash_context_attention(q, q, q, ids, ids, kernel=cudnn_kernel(scale=1.0))
