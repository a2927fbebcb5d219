"""DeepSeek-V3's sequence-wise balance loss (report eq. 17-20; `models.moe.seq_balance`,
`model.seq_aux_loss_coef`) on the tiny golden (tests/golden/make_hf_deepseek_goldens.py),
against the formula in numpy over transformers' own router logits (transformers' DeepseekV3
has no such loss to compare with)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_deepseek_v3 import NAME, _numpy_choice, golden
from test_hf import GOLDEN

from fsdp_jax.app.hf import load as hf
from fsdp_jax.app.models import Decoder, DecoderConfig
from fsdp_jax.app.trainer.build import make_loss_fn
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile
from fsdp_jax.model.fns import from_nnx

ALPHA = 0.01
K, E = 2, 8  # the golden's experts per token and routed experts


def reference(logits: np.ndarray, bias: np.ndarray, rows: int) -> float:
    """Eq. 18-20 for one layer, averaged over the sequences: sum_e f_e P_e, f_e = E / (K T) x
    the tokens of the sequence that chose e, P_e = its mean of s'_e = s_e / sum_j s_j (sigmoid
    scores s)."""
    s = 1 / (1 + np.exp(-logits.astype(np.float64)))
    s_norm = (s / s.sum(-1, keepdims=True)).reshape(rows, -1, E)
    hits = np.zeros((len(logits), E))
    np.put_along_axis(hits, _numpy_choice(logits, bias), 1.0, axis=-1)
    hits = hits.reshape(rows, -1, E)
    t = hits.shape[1]
    f = E / (K * t) * hits.sum(1)
    return float(np.mean(np.sum(f * s_norm.mean(1), -1)))


@pytest.fixture(scope="module")
def out():
    """The training loss and its aux without and with alpha, on the golden's 2 x 40 tokens (the
    model sees the first 39 of each row)."""
    ckpt = hf.HFCheckpoint(GOLDEN / NAME, base=DecoderConfig(scan_layers=True))
    with_alpha = dataclasses.replace(ckpt.config, seq_aux_loss_coef=ALPHA)
    m = from_nnx(lambda r: Decoder(ckpt.config, rngs=r))
    params = hf.load_params(ckpt, m.abstract_params)
    tokens = jnp.asarray(golden()["tokens"], jnp.int32)
    run = jax.jit(lambda p: (make_loss_fn(m, ckpt.config)(p, tokens), make_loss_fn(m, with_alpha)(p, tokens)))
    return run(params)


def test_term_matches_the_reports_formula_on_transformers_router(out):
    ours = float(out[1][1]["router_seq_aux_loss"])
    g, f = golden(), SafetensorsFile(GOLDEN / NAME / "model.safetensors")
    want = 0.0
    for i in (1, 2):
        logits = g[f"router_logits_{i}"].reshape(2, 40, E)[:, :39].reshape(-1, E)
        want += reference(logits, f.read(f"model.layers.{i}.mlp.gate.e_score_correction_bias"), 2)
    assert abs(ours - want) <= 1e-5 * want, (ours, want)
    assert 2.0 < want < 2.0 * E / K  # two sparse layers: 1 each when balanced, E / K at most


def test_alpha_adds_the_term_to_the_loss(out):
    (plain, aux0), (alpha, aux1) = out
    term = float(aux1["router_seq_aux_loss"])
    assert float(alpha - plain) == pytest.approx(ALPHA * term, rel=1e-4)
    assert float(aux0["router_seq_aux_loss"]) == term  # measured whether or not it is trained
