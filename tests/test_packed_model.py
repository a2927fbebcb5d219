"""The model on packed rows: attention never crosses an example boundary and RoPE
restarts per example, so a packed row's logits equal each example run alone."""

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fsdp_jax.app.data.packing import batch_from_rows, pack
from fsdp_jax.app.models.attention import packed_layout
from fsdp_jax.app.models.config import LlamaConfig
from fsdp_jax.app.models.llama import Llama


@pytest.mark.slow
@pytest.mark.parametrize("scan, remat", [(True, "none"), (False, "dots")])
def test_packed_logits_equal_examples_run_alone(scan, remat):
    cfg = LlamaConfig(
        vocab_size=64, d_model=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=32, scan_layers=scan
    )
    with nnx.use_eager_sharding(False):
        model = Llama(cfg, rngs=nnx.Rngs(0), remat=remat)
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
    seqlen, offsets = packed_layout(seg)
    assert seqlen[:, :4].tolist() == [[3, 2, 1, -1], [8, -1, -1, -1]]
    assert (seqlen[:, 4:] == -1).all()
    assert offsets[:, :5].tolist() == [[0, 3, 5, -1, -1], [0, -1, -1, -1, -1]]
    assert offsets.shape == (2, 9) and (offsets[:, 5:] == -1).all()
