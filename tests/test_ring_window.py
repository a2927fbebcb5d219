"""Sliding windows in the flash ring with static-mask kernels (`fsdp_jax.attention.windows`):
each ring step as chunk pairs whose static band a `lax.switch` on the rank picks.

The plan's bands, over every rank, step and chunk pair, equal the zig-zag row's own window
mask (numpy, brute force); cuDNN's pieces of a band cover it exactly once. On CPU (float32,
context 2 and 4, ring and all-gather), against one device's dense attention written
independently (`test_ring_attention.dense_reference`): the output o element by element and the
grads of q, k, v within 1e-5 of their largest, for windows shorter than a chunk, crossing one
and spanning several, always on or a pattern's local / global layer (the flag traced), with
the pure-JAX kernel given bands, the cuDNN kernel's own code over an emulated cuDNN (its
CAUSAL / NO_MASK / sliding-window semantics in the reference kernel) and splash interpreted
with packed rows' segment ids."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_cudnn_packed import emulated_cudnn as emulated_packed
from test_ring_flash import dense_value_and_grad, inputs

import fsdp_jax as fj
from fsdp_jax.attention.cudnn import cudnn_kernel
from fsdp_jax.attention.cudnn_bands import band_pieces
from fsdp_jax.attention.flash import flash_context_attention
from fsdp_jax.attention.kernels import CAUSAL, FULL, Band, band_mask, reference_kernel
from fsdp_jax.attention.windows import pair_band, plan_summary, window_plan
from fsdp_jax.sharding.context import zigzag


def _chunk(r, side, n):
    return r if side == 0 else 2 * n - 1 - r


@pytest.mark.parametrize("n", [1, 2, 3, 4])
@pytest.mark.parametrize("c", [4, 8])
def test_plan_bands_equal_the_rows_window_mask_on_every_pair(n, c):
    mask_of = functools.cache(lambda band: np.asarray(band_mask(band, c, c)))  # a few bands, ~1,700 pairs
    for window in (1, 3, c - 1, c, c + 1, 2 * c - 1, 2 * c + 3, 5 * c, 100 * c):
        for pattern in (False, True):
            plan = window_plan(n=n, c=c, window=window, pattern=pattern)
            for flag in (False, True) if pattern else (True,):
                for i in range(n):
                    for t in range(n):
                        j = (i - t) % n
                        for x in (0, 1):
                            for y in (0, 1):
                                a, b = _chunk(i, x, n), _chunk(j, y, n)
                                d = a * c + np.arange(c)[:, None] - (b * c + np.arange(c)[None, :])
                                want = (d >= 0) & ((d < window) | (not flag))
                                pp = plan.get((t, x, y))
                                if pp is None:
                                    assert not want.any(), (window, i, t, x, y)
                                    continue
                                k = pp.table[int(flag) if pattern else 0][i]
                                got = np.zeros_like(want) if k == len(pp.bands) else mask_of(pp.bands[k])
                                assert (got == want).all(), (window, flag, i, t, x, y, pp)


def test_a_window_shorter_than_a_chunk_traces_only_the_neighbours_pairs():
    """128k at context 8 (chunks of 8192) with Mistral's window 4096: only pairs of a chunk and
    itself or its predecessor are traced: the two diagonals and the middle rank's own pair at
    step 0, the predecessor pairs at steps 1 and 7: 5 calls, where the half-block ring traces
    15 (1 + 2 per later step)."""
    got = plan_summary(window_plan(n=8, c=8192, window=4096, pattern=False))
    assert got["calls"] == 5 and got["pairs"] == 5, got
    assert set(got["bands"]) <= {str(Band(0, 4096)), str(Band(None, 4096 - 8192))}, got
    assert pair_band(2, 8192, 4096, True) is None and pair_band(0, 8192, 9000, True) == CAUSAL
    assert pair_band(1, 8192, 4096, False) == FULL


def test_cudnn_pieces_cover_a_band_exactly_once():
    c = 8
    for band in [FULL, CAUSAL, Band(0, 3), *[Band(None, h) for h in range(-(c - 2), c)]]:
        cover = np.zeros((c, c), int)
        for qi, ki, kind in band_pieces(band, c, c):
            sq, sk = qi.stop - qi.start, ki.stop - ki.start
            xs, ys = np.arange(sq)[:, None], np.arange(sk)[None, :]
            if kind == "full":
                m = np.ones((sq, sk), bool)
            elif kind == "causal":
                m = ys <= xs
            elif kind == "anti":
                assert sq == sk, band
                m = ys >= xs
            else:
                m = (ys <= xs) & (xs - ys < kind)
            cover[qi, ki] += m
        assert (cover == np.asarray(band_mask(band, c, c))).all(), (band, cover)


def emulated_cudnn():
    """(fwd, bwd) with `ring_cudnn._plain_fwd` / `_plain_bwd`'s signatures: cuDNN's CAUSAL,
    NO_MASK and sliding window (keys x - W < y <= x) in the reference kernel."""

    def band(causal, window):
        return Band(0, window) if window else (CAUSAL if causal else FULL)

    def ids(x):
        return jnp.zeros(x.shape[:2], jnp.int32)

    def fwd(q, k, v, causal, window, *, scale):
        o, lse = reference_kernel(scale=scale).fwd(q, k, v, None, None, ids(q), ids(k), None, band(causal, window))
        return o.astype(q.dtype), lse

    def bwd(q, k, v, o, lse, do, causal, window, *, scale):
        ref = reference_kernel(scale=scale)
        return ref.bwd(q, k, v, None, None, ids(q), ids(k), None, o, lse, do, band(causal, window))

    return fwd, bwd


def check_ring(kernel, n, kv_pass, args, *, window, local, segments):
    """The ring's o (every element) and grads of sum(o * w) against one device's, rel <= 1e-5;
    `local` None: the window always applies, else the values of the pattern's traced flag to
    check, each a call of the one compiled ring."""
    q, k, v, w, pos, seg = args
    mesh = fj.make_mesh(fsdp=8 // n, context=n)

    def ring(q, k, v, pos, seg, w, flag):
        zq, zk, zv, zp, zs, zw = zigzag((q, k, v, pos, seg, w), n)
        kw = dict(kernel=kernel, local=None if local is None else flag, kv_pass=kv_pass)
        o = flash_context_attention(zq, zk, zv, zp, zs if segments else None, **kw)
        return jnp.sum(o * zw), o

    f = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2), has_aux=True))
    for flag in (True,) if local is None else local:
        with jax.set_mesh(mesh):
            (_, o), g = f(q, k, v, pos, seg, w, jnp.asarray(flag))
        # one device's dense attention (`test_ring_attention.dense_reference`), compiled once per
        # shape, window and flag in this process: the kernels' tests of a window share it
        _, ref_g, o_ref = dense_value_and_grad({"window": window, "local": flag}, args, with_o=True)
        for name, a, r in zip(("o", "q", "k", "v"), (o, *g), (zigzag(o_ref, n), *ref_g)):
            err = float(jnp.max(jnp.abs(a - r)) / jnp.max(jnp.abs(r)))
            assert err <= 1e-5, (name, flag, err)


# (context, window, local): rows of 32, chunks of 8 (context 2) or 4 (context 4); a pattern's flag
# is traced, so its local and global layers (True, False) are one compiled ring called twice
WINDOWS = [(2, 3, None), (2, 13, (True, False)), (4, 3, (True,)), (4, 6, None), (4, 21, None)]


# The packed cuDNN kernel's windowed rings compile for 10-18 s each (a whole run's junit, 2 workers):
# the fast subset keeps the first (a window shorter than a chunk, context 2: the packed pieces with
# cuDNN's window and the reversed squares' two span calls; a mutation of either fails it, BENCHMARKS.md
# "Issue 55 item 6, the fast subset"); the rest run in the whole suite, as do context 4 and the
# longer windows through the unpacked cuDNN kernel and the banded reference below (both slow);
# packed rows at context 4 run through test_cudnn_packed's ring.
def _id(value):
    return "-".join(map(str, value)) if isinstance(value, tuple) else str(value)


PACKED_WINDOWS = [WINDOWS[0], *(pytest.param(*w, marks=pytest.mark.slow) for w in WINDOWS[1:])]


@pytest.mark.parametrize(("n", "window", "local"), WINDOWS, ids=_id)
@pytest.mark.slow
def test_banded_reference_ring_matches_one_device(n, window, local):
    args = inputs({"packed": True}, b=8 // n)
    kern = reference_kernel(scale=args[0].shape[-1] ** -0.5, window=window, banded=True)
    check_ring(kern, n, "ring" if window % 2 else "all_gather", args, window=window, local=local, segments=True)


@pytest.mark.parametrize(("n", "window", "local"), WINDOWS, ids=_id)
@pytest.mark.slow
def test_cudnn_kernel_with_windows_over_emulated_cudnn_matches_one_device(n, window, local):
    """Unpacked rows (the cuDNN kernel takes windows without segment ids), 4 query heads on 2
    kv heads: the pieces, reversals and merges of `band_pieces` are the kernel's own code."""
    q, k, v, w, _, _ = inputs({}, b=8 // n)
    s = q.shape[1]
    args = (q, k, v, w, jnp.broadcast_to(jnp.arange(s), (8 // n, s)), jnp.zeros((8 // n, s), jnp.int32))
    kern = cudnn_kernel(scale=q.shape[-1] ** -0.5, window=window, backend=emulated_cudnn())
    check_ring(kern, n, "all_gather" if window % 2 else "ring", args, window=window, local=local, segments=False)


@pytest.mark.parametrize(("n", "window", "local"), PACKED_WINDOWS, ids=_id)
def test_packed_cudnn_kernel_with_windows_over_emulated_cudnn_matches_one_device(n, window, local):
    """Packed rows (segments across chunks and blocks, padding at row ends), 4 query heads on
    2 kv heads: cuDNN's packed layout per piece, the one segment across the gap of a reversed
    square as two calls, over an emulated cuDNN (`test_cudnn_packed.emulated_cudnn`)."""
    args = inputs({"packed": True}, b=8 // n)
    kern = cudnn_kernel(scale=args[0].shape[-1] ** -0.5, window=window, packed=True, backend=emulated_packed())
    check_ring(kern, n, "ring" if window % 2 else "all_gather", args, window=window, local=local, segments=True)


@pytest.mark.slow
@pytest.mark.parametrize(
    ("n", "window", "local"), [(2, 100, None), (2, 300, (True,)), (4, 130, (False,)), (4, 200, None)], ids=_id
)
def test_interpreted_splash_ring_with_windows_and_packed_rows_matches_one_device(n, window, local):
    """Chunks of 128 (splash's backward wants key tiles of 128), 2 query heads on one kv head,
    head dim 128, packed rows: windows inside a chunk, across one, across several."""
    from fsdp_jax.attention.splash_block import splash_kernel

    args = inputs({"packed": True, "kvh": 1}, b=8 // n, s=256 * n, h=2, dh=128)
    kern = splash_kernel(scale=128**-0.5, window=window, interpret=True, block=128)
    check_ring(kern, n, "ring" if n == 2 else "all_gather", args, window=window, local=local, segments=True)
