"""NF4 / blockwise 8-bit / int8 quantisation equal bitsandbytes 0.50's output bit for bit
(goldens: tests/golden/make_nf4_goldens.py), in NumPy and in JAX.

The JAX side runs jitted (one program per case and function, as the library runs them inside
its jitted quantise), not op by op: eager, each primitive of each case compiled on its own."""

from __future__ import annotations

from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsdp_jax.quant import codes as C

G = np.load(Path(__file__).parent / "golden" / "quant" / "bnb.npz")
CASES = sorted({k.split("/")[0] for k in G.files if "/" in k})


# the JAX quantisers jitted (`xp` and the sizes static): one program per case and shape
_NF4 = jax.jit(C.nf4_quantize, static_argnums=(0, 2))
_NF4_DEQUANT = jax.jit(C.nf4_dequantize, static_argnums=(0, 3, 4))
_BLOCKWISE = jax.jit(C.blockwise_quantize, static_argnums=(0, 2))
_AS_F32 = jax.jit(lambda x: x.astype(jnp.float32))
_ROUND_TRIP = jax.jit(lambda x, dtype: x.astype(dtype).astype(jnp.float32), static_argnums=1)


def _int8_rows(xp, x):
    """int8 codes and absmax of x's rows (..., out) as a torch (out, in) weight's rows."""
    return C.int8_quantize(xp, xp.reshape(x, (-1, x.shape[-1])).T, (0,))


_INT8 = jax.jit(_int8_rows, static_argnums=0)


def _run(fn, jitted, xp, *args):
    """`fn(xp, *args)`: NumPy as it is, JAX through its jitted twin."""
    return fn(xp, *args) if xp is np else jitted(xp, *args)


def _x(name):
    """The case's input as bitsandbytes saw it (bf16 / fp16 from their bits)."""
    x, dt = G[f"{name}/x"], str(G[f"{name}/dtype"])
    if dt == "bfloat16":
        return jnp.asarray(x.view(jnp.bfloat16))
    return jnp.asarray(x.view(np.float16) if dt == "float16" else x)


def _both(name):
    x = _x(name)
    return [(np, np.asarray(_AS_F32(x))), (jnp, x)]


def test_tables():
    assert np.array_equal(C.NF4, G["nf4_code"])
    assert np.array_equal(C.dynamic_map(), G["dynamic_map"])


@pytest.mark.parametrize("name", CASES)
@pytest.mark.fast_cases("f32_odd")
def test_nf4_codes_and_absmax_equal_bitsandbytes(name):
    for xp, x in _both(name):
        packed, absmax = _run(C.nf4_quantize, _NF4, xp, x, 64)
        assert np.array_equal(np.asarray(packed), G[f"{name}/nf4_codes"]), xp.__name__
        assert np.array_equal(np.asarray(absmax), G[f"{name}/nf4_absmax"]), xp.__name__
        if f"{name}/nf4_dequant" in G.files:  # dequantised in float32, then to the input's dtype
            out = _run(C.nf4_dequantize, _NF4_DEQUANT, xp, packed, absmax, x.size, 64)
            want = G[f"{name}/nf4_dequant"].reshape(-1)
            got = np.asarray(_ROUND_TRIP(jnp.asarray(out), _x(name).dtype))
            assert np.array_equal(got, want), xp.__name__


@pytest.mark.parametrize("name", CASES)
def test_double_quant_equals_bitsandbytes(name):
    """compress_statistics: the absmax minus their mean, blockwise 8-bit in blocks of 256."""
    _, absmax = C.nf4_quantize(np, np.asarray(_AS_F32(_x(name))), 64)
    offset = np.float32(np.mean(absmax, dtype=np.float64))
    assert offset == G[f"{name}/dq_offset"]
    for xp in (np, jnp):
        codes, absmax2 = _run(C.blockwise_quantize, _BLOCKWISE, xp, xp.asarray(absmax - offset), 256)
        assert np.array_equal(np.asarray(codes), G[f"{name}/dq_absmax_codes"]), xp.__name__
        assert np.array_equal(np.asarray(absmax2), G[f"{name}/dq_absmax2"]), xp.__name__


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("block", [256, 64])
def test_blockwise_equals_bitsandbytes(name, block):
    """Equal to the portable backend bit for bit; the CPU C++ kernel's bin search differs on
    few values: every exact zero (code 131 for 0.0, not 127) and at most 1% of the others."""
    for xp, x in _both(name):
        codes, absmax = _run(C.blockwise_quantize, _BLOCKWISE, xp, x, block)
        assert np.array_equal(np.asarray(codes), G[f"{name}/bw{block}_portable_codes"].reshape(-1)), xp.__name__
        assert np.array_equal(np.asarray(absmax), G[f"{name}/bw{block}_absmax"]), xp.__name__
        nonzero = np.asarray(x).reshape(-1) != 0
        differ = np.asarray(codes) != G[f"{name}/bw{block}_codes"].reshape(-1)
        assert np.mean(differ[nonzero]) <= 0.01, np.mean(differ[nonzero])


@pytest.mark.parametrize("name", CASES)
def test_int8_equals_bitsandbytes(name):
    """Per output channel: bitsandbytes' rows of a torch (out, in) weight are our (in, out)
    layout's columns, the absmax over the input dim."""
    for xp, x in _both(name):
        codes, absmax = _run(_int8_rows, _INT8, xp, x)
        assert np.array_equal(np.asarray(codes).T, G[f"{name}/int8_codes"]), xp.__name__
        assert np.array_equal(np.asarray(absmax).reshape(-1), G[f"{name}/int8_absmax"]), xp.__name__
