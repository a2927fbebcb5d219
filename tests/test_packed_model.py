"""The model on packed rows: attention never crosses an example boundary and RoPE
restarts per example, so a packed row's logits equal each example run alone."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fsdp_jax.app.data.packing import batch_from_rows, pack
from fsdp_jax.app.models.attention import packed_layout
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import Decoder


@pytest.mark.slow
@pytest.mark.parametrize("scan, remat", [(True, "none"), (False, "dots")])
def test_packed_logits_equal_examples_run_alone(scan, remat):
    cfg = DecoderConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, scan_layers=scan
    )
    with nnx.use_eager_sharding(False):  # initialised by one program (eagerly, one per op)
        graphdef, params = nnx.split(nnx.jit(lambda: Decoder(cfg, rngs=nnx.Rngs(0), remat=remat))())

    # the model's forward compiled once per shape: run eagerly, its ops compiled one tiny program
    # each (502 compiles for the unscanned model in a whole-run profile, BENCHMARKS.md "Issue 55
    # item 6, ring and packed attention"); jit changes nothing the test compares
    @jax.jit
    def forward(params, tokens, segment_ids=None, positions=None):
        return nnx.merge(graphdef, params)(tokens, segment_ids, positions)

    model = functools.partial(forward, params)

    rng = np.random.default_rng(1)
    lengths = [7, 12, 3, 9, 5, 16, 11]
    examples = [(rng.integers(0, 64, n), np.ones(n, np.uint8)) for n in lengths]
    tok, msk, seg = pack(examples, 32)
    b = batch_from_rows(tok, msk, seg)
    packed = np.asarray(model(jnp.asarray(b["inputs"]), jnp.asarray(b["segment_ids"]), jnp.asarray(b["positions"])))
    worst = 0.0
    for r in range(len(tok)):
        for s in range(1, seg[r].max() + 1):
            at = np.flatnonzero(seg[r] == s)
            alone = np.asarray(model(jnp.asarray(tok[r, at][None].astype(np.int32))))[0]
            worst = max(worst, float(np.abs(packed[r, at] - alone).max()))
    print(f"max |packed - alone| logits: {worst:.2e}")
    assert worst <= 1e-5, worst
    # without segment ids the same row does mix examples (the test can fail)
    mixed = np.asarray(model(jnp.asarray(b["inputs"])))
    assert np.abs(mixed - packed).max() > 1e-3


def test_cudnn_packed_layout():
    seg = jnp.asarray([[1, 1, 1, 2, 2, 3, 0, 0], [1, 1, 1, 1, 1, 1, 1, 1]])
    # compiled whole and read on the host (eagerly, each op and check was a program: 20)
    seqlen, offsets = (np.asarray(x) for x in jax.jit(packed_layout)(seg))
    assert seqlen[:, :4].tolist() == [[3, 2, 1, -1], [8, -1, -1, -1]]
    assert (seqlen[:, 4:] == -1).all()
    assert offsets[:, :5].tolist() == [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]]
    assert offsets.shape == (2, 9) and (offsets[:, 5:] == -1).all()


@pytest.mark.slow
def test_cudnn_packed_attention_with_grouped_kv_reads_the_right_rows(monkeypatch):
    """The context-1 cuDNN path of packed rows (`models.attention.attention(..., "cudnn")`) over an
    emulated cuDNN that reads each segment's tokens where the element offsets jax computes
    (`_fix_seqlen_offsets`, this jax's own) point in the flat q / K / V buffers, with grouped-query
    K/V (8 q heads on 2): equal to the XLA path. jax 0.10 scales K/V offsets by q's heads, so
    unrepeated K/V would be read at 4x their token offsets."""
    from jax._src.cudnn import fused_attention_stablehlo as fa

    from fsdp_jax.app.models.attention import attention

    def fake(q, k, v, *, q_seqlen, kv_seqlen, q_offsets, kv_offsets, scale, mask_type):
        assert mask_type == fa.MaskType.PADDING_CAUSAL
        qs, kvs, qo, ko = fa._fix_seqlen_offsets(q_seqlen, kv_seqlen, q_offsets, kv_offsets, q, k)
        b, t, n, dh = q.shape
        s_, kh = k.shape[1], k.shape[2]
        g = qs.size  # segments over the batch, valid ones first (as cuDNN reads them)
        qs, kvs, qo, ko = qs.reshape(-1), kvs.reshape(-1), qo.reshape(-1)[:g], ko.reshape(-1)[:g]
        qt, kt = qo // (n * dh), ko // (kh * dh)  # flat token index of each segment's start
        i, j = jnp.arange(b * t)[:, None, None], jnp.arange(b * s_)[None, :, None]
        on = (qs > 0)[None, None]
        mask = jnp.any(
            on & (i >= qt) & (i < qt + qs) & (j >= kt) & (j < kt + kvs) & (j - kt <= i - qt), axis=-1
        )  # (B T, B S)
        qf, kf, vf = q.reshape(b * t, n, dh), k.reshape(b * s_, kh, dh), v.reshape(b * s_, kh, dh)
        kf, vf = jnp.repeat(kf, n // kh, axis=1), jnp.repeat(vf, n // kh, axis=1)
        sc = jnp.where(mask[None], jnp.einsum("ind,jnd->nij", qf, kf) * scale, -jnp.inf)
        p = jnp.where(mask.any(-1)[None, :, None], jax.nn.softmax(sc, axis=-1), 0.0)
        return jnp.einsum("nij,jnd->ind", p, vf).reshape(b, t, n, dh)

    monkeypatch.setattr(fa, "dot_product_attention", fake)
    keys = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(keys[0], (2, 16, 8, 8))
    k, v = (jax.random.normal(x, (2, 16, 2, 8)) for x in keys[1:])
    seg = jnp.asarray([[1] * 5 + [2] * 7 + [3] * 4, [1] * 9 + [2] * 7])
    # each path compiled whole (eagerly, their ops compiled ~130 tiny programs)
    run = jax.jit(attention, static_argnums=4)
    got = run(q, k, v, seg, "cudnn")
    want = run(q, k, v, seg, "xla")
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
