"""cuDNN's packed layout per ring block (`fsdp_jax.attention.cudnn_packed`), on CPU: for random
packed rows (segments crossing chunk and block boundaries, one spanning a rank's two chunks,
padding at the end) and every zig-zag block pair at context 2 and 4, the THD semantics read
from the layout alone (`thd_mask`) equal the row's own mask restricted to the block: same
segment and key position <= query position (global row positions). Plus the stats round trip
and the overflow flag. And the whole ring with the cuDNN packed kernel's own code (layout,
grouped-query heads repeated and folded back, stats mapped both ways, uncovered rows masked)
over an emulated cuDNN (`thd_mask` semantics in the pure-JAX reference kernel, stats in the
packed layout) against one device's dense attention with segment ids."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_ring_flash import dense_value_and_grad, inputs, rel_err, ring_value_and_grad

from fsdp_jax.app.data.packing import positions_from_segments
from fsdp_jax.attention.cudnn import packed_kernel
from fsdp_jax.attention.cudnn_packed import block_layout, packed_stats, thd_mask, token_lse
from fsdp_jax.attention.kernels import reference_kernel
from fsdp_jax.sharding.context import zigzag_order

# compiled whole, once per shape, rather than op by op (the layout tests call them ~150 times;
# the stats and overflow tests share one (2, 8) layout program)
layout_of = jax.jit(block_layout, static_argnames="max_segments")
mask_of = jax.jit(thd_mask, static_argnums=(1, 2), static_argnames="causal")


def rows(b, s, seed):
    """Packed rows: segments 1, 2, ... of random lengths (some long), padding 0 at some ends."""
    rng = np.random.default_rng(seed)
    seg = np.zeros((b, s), np.int32)
    for r in range(b):
        at, n = 0, 1
        end = s - int(rng.integers(0, 5)) if r % 2 else s
        while at < end:
            ln = int(rng.integers(1, 4)) if rng.random() < 0.6 else int(rng.integers(s // 4, s))
            seg[r, at : min(end, at + ln)] = n
            at, n = at + ln, n + 1
    seg[0, :] = np.repeat([1, 2, 3], [1, s - 2, 1])  # one segment over every chunk
    return seg


def blocks(context, s):
    """(name, q row positions, kv row positions, causal) of every ring block pair."""
    order = zigzag_order(s, context)
    sc, half = s // context, s // context // 2
    own = [order[i * sc : (i + 1) * sc] for i in range(context)]
    for i in range(context):
        yield f"own{i}", own[i], own[i], True
        for j in range(context):
            if j < i:
                yield f"{i}<-{j}", own[i], own[j][:half], False
            elif j > i:
                yield f"{i}<-{j}", own[i][half:], own[j], False


@pytest.mark.parametrize("context", [2, 4])
@pytest.mark.parametrize("seed", [0, 1, 2])
@pytest.mark.fast_cases("0-2")
def test_layout_semantics_equal_the_rows_mask_on_every_block(context, seed):
    s = 64
    seg = rows(3, s, seed)
    for name, qpos, kpos, causal in blocks(context, s):
        qs, ks = jnp.asarray(seg[:, qpos]), jnp.asarray(seg[:, kpos])
        lay = layout_of(qs, ks, max_segments=len(qpos))
        got = np.asarray(mask_of(lay, len(qpos), len(kpos), causal=causal))
        want = (seg[:, qpos][:, :, None] == seg[:, kpos][:, None, :]) & (kpos[None, None, :] <= qpos[None, :, None])
        assert (got == want).all(), (name, np.argwhere(got != want)[:5])
        assert not np.asarray(lay.overflow).any()
        sees = want.any(axis=2)  # queries that meet a key of the block; keys that meet a query
        assert ((np.asarray(lay.q_seg) >= 0) == sees).all(), name
        assert (np.asarray(lay.kv_covered) == want.any(axis=1)).all(), name
        if causal:  # own block: each segment's q and kv rows are the same rows
            assert (np.asarray(lay.q_offsets) == np.asarray(lay.kv_offsets)).all(), name
            assert (np.asarray(lay.q_seqlen) == np.asarray(lay.kv_seqlen)).all(), name


@pytest.mark.slow
def test_stats_round_trip_and_layout_conventions():
    seg = jnp.asarray([[1, 1, 2, 2, 2, 3, 0, 0], [4, 4, 4, 4, 5, 5, 6, 6]])
    ks = jnp.asarray([[1, 2, 2, 2, 2, 2, 2, 2], [5, 5, 5, 5, 6, 6, 7, 7]])
    lay = layout_of(seg, ks, max_segments=4)
    np.testing.assert_array_equal(lay.q_seqlen, [[2, 3, -1, -1], [2, 2, -1, -1]])
    np.testing.assert_array_equal(lay.kv_seqlen, [[1, 7, -1, -1], [4, 2, -1, -1]])
    np.testing.assert_array_equal(lay.q_offsets, [[0, 2, -1, -1, -1], [4, 6, -1, -1, -1]])
    np.testing.assert_array_equal(lay.kv_offsets, [[0, 1, -1, -1, -1], [0, 4, -1, -1, -1]])
    # the maps compiled whole (pure data movement: jit changes no value); eagerly, ~100 programs
    lse = np.arange(2 * 8 * 3, dtype=np.float32).reshape(2, 8, 3)
    stats = np.asarray(jax.jit(packed_stats)(lse, lay))
    assert stats.shape == (2 * 4, 3, 8)
    assert float(stats[2, 1, 1]) == float(lse[1, 5, 1])  # row 1's first segment is stats row 2
    back = np.asarray(jax.jit(token_lse)(stats, lay))
    seen = np.asarray(lay.q_seg) >= 0
    np.testing.assert_array_equal(back[seen], lse[seen])
    assert np.isneginf(back[~seen]).all() and (~seen).sum() == 7


@pytest.mark.parametrize("context", [2, 4])
@pytest.mark.slow
def test_a_row_within_max_segments_never_overflows_a_block(context):
    """The trainer's bound (`data.batches.check_segments`: a row's segments <= model.max_segments)
    is enough: no block of the row has more segments on its q side (a block's ids keep the row's
    order, so its runs are a subset of the row's)."""
    s = 64
    for seed in range(4):
        seg = rows(3, s, seed)
        runs = 1 + int((seg[:, 1:] != seg[:, :-1]).sum(axis=1).max())
        for name, qpos, kpos, _ in blocks(context, s):
            lay = layout_of(jnp.asarray(seg[:, qpos]), jnp.asarray(seg[:, kpos]), max_segments=runs)
            assert not np.asarray(lay.overflow).any(), (seed, name, runs)


def test_more_segments_than_max_segments_is_flagged():
    seg = jnp.asarray([[1, 2, 3, 4, 5, 5, 5, 5], [1, 1, 1, 1, 2, 2, 2, 2]])
    lay = layout_of(seg, seg, max_segments=4)
    np.testing.assert_array_equal(lay.overflow, [True, False])


def emulated_cudnn():
    """(fwd, bwd) with `ring_cudnn._cudnn_fwd` / `_cudnn_bwd`'s signatures: the THD semantics of
    the layout (`thd_mask`, with cuDNN's sliding window per segment) computed by the reference
    kernel, stats in cuDNN's packed layout."""

    def kern(lay, sq, sk, scale, window):
        mask = lambda *_, causal: thd_mask(lay, sq, sk, causal=causal, window=window)  # noqa: E731
        return reference_kernel(scale=scale, mask=mask)

    def fwd(q, k, v, lay, causal, *, scale, window=None):
        o, lse = kern(lay, q.shape[1], k.shape[1], scale, window).fwd(q, k, v, None, None, None, None, None, causal)
        return o.astype(q.dtype), packed_stats(lse, lay)

    def bwd(q, k, v, lay, causal, stats, o, do, *, scale, window=None):
        ref = kern(lay, q.shape[1], k.shape[1], scale, window)
        return ref.bwd(q, k, v, None, None, None, None, None, o, token_lse(stats, lay), do, causal)

    return fwd, bwd


@pytest.mark.parametrize("kv_pass", ["ring", "all_gather"])
@pytest.mark.parametrize(("n", "kvh"), [(2, 2), (4, 1), (4, 4)])
@pytest.mark.fast_cases("2-2-ring")
def test_packed_cudnn_kernel_ring_over_emulated_cudnn_matches_one_device(n, kvh, kv_pass):
    q, k, v, w, _, _ = inputs({"kvh": kvh}, b=8 // n, s=64)
    seg = rows(8 // n, 64, seed=n + kvh)
    args = (q, k, v, w, jnp.asarray(positions_from_segments(seg)), jnp.asarray(seg))
    kern = packed_kernel(scale=q.shape[-1] ** -0.5, max_segments=32, backend=emulated_cudnn())
    # one compiled step gives the loss, the grads and the ring's o (in row order)
    out, g, _, o = ring_value_and_grad({"packed": True}, kern, n, kv_pass, args, with_o=True)
    ref, ref_g, o_ref = dense_value_and_grad({"packed": True}, args, with_o=True)
    # the forward itself: o, every element, against one device's (relative to its largest, as
    # the grads); the loss sum(o * w) is a probe for the grads whose 4096 terms of either
    # sign nearly cancel (-0.84 at context 4 on one kv head), too ill-conditioned to hold at 1e-5
    err = rel_err(o, o_ref)
    assert err <= 1e-5, ("o", err)
    for name, a, r in zip("qkv", g, ref_g):
        err = rel_err(a, r)
        assert err <= 1e-5, (name, err)


@pytest.mark.slow
def test_a_block_with_too_many_segments_poisons_its_row():
    q, k, v, w, _, _ = inputs({}, b=4, s=64)
    seg = rows(4, 64, seed=5)
    args = (q, k, v, w, jnp.asarray(positions_from_segments(seg)), jnp.asarray(seg))
    kern = packed_kernel(scale=q.shape[-1] ** -0.5, max_segments=2, backend=emulated_cudnn())
    out, _, _ = ring_value_and_grad({"packed": True}, kern, 2, "all_gather", args)
    assert np.isnan(float(out))
