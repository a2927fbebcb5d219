"""Block-scaled FP8 checkpoints (DeepSeek-V3's published format; `app/hf/fp8_blocks.py`) dequantised on
import: the tiny DeepSeek-V3 golden stored as float8_e4m3fn with 16 x 16 `weight_scale_inv` blocks
(tests/golden/make_hf_deepseek_fp8_golden.py) gives transformers' logits of the dequantised model;
a slice read equals the whole tensor's dequantisation, sliced; bad scales and keys are one line."""

from __future__ import annotations

import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_deepseek_v3 import imported
from test_hf import GOLDEN

from fsdp_jax.app.hf import fp8_blocks
from fsdp_jax.app.hf import load as hf
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from fsdp_jax.errors import CheckpointError, ConfigError
from fsdp_jax.train.step import sharding_context

NAME = "deepseek_v3_fp8"
W = "model.layers.1.self_attn.kv_b_proj.weight"  # (160, 32): 10 x 2 blocks of 16


def _golden(name):
    f = SafetensorsFile(GOLDEN / f"{name}_logits.safetensors")
    return {k: f.read(k) for k in f.tensors}


def test_import_gives_transformers_logits_of_the_dequantised_model():
    g = _golden(NAME)
    params, m, plan, cfg = imported(path=GOLDEN / NAME)
    with sharding_context(plan):
        logits = np.asarray(jax.jit(m.apply)(params, jnp.asarray(np.tile(g["tokens"], (4, 1)))))[:2]
    err = float(np.abs(logits - g["logits"]).max())
    assert err < 1e-4, err
    moved = float(np.abs(logits - _golden("deepseek_v3")["logits"]).max())
    assert moved > 100 * err  # the FP8 rounding moved the logits: a dequantisation that ignored it would fail


def test_a_slice_reads_as_the_whole_dequantised_tensor_sliced():
    f = SafetensorsFile(GOLDEN / NAME / "model.safetensors")
    q, s = f.read(W).astype(np.float32), f.read(W + fp8_blocks.SCALE)
    assert f.dtype(W).name == "float8_e4m3fn" and s.shape == (10, 2)
    whole = q * np.kron(s, np.ones((16, 16), np.float32))  # every element times its block's scale
    view = fp8_blocks.Fp8Weight(f, f, (16, 16))
    assert np.array_equal(view.read(W, dtype=np.float32), whole)
    assert np.array_equal(view.read(W, slice(5, 37), slice(3, 29), dtype=np.float32), whole[5:37, 3:29])


def _copy(tmp_path, edit_config=None, scale=None):
    out = tmp_path / "ckpt"
    shutil.copytree(GOLDEN / NAME, out)
    if edit_config:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"].update(edit_config)
        (out / "config.json").write_text(json.dumps(cfg))
    if scale is not None:
        f = SafetensorsFile(out / "model.safetensors")
        tensors = {k: f.read(k) for k in f.tensors}
        tensors[W + fp8_blocks.SCALE] = scale
        entries = [(k, v.shape, v.dtype) for k, v in tensors.items()]
        write_safetensors(out / "model.safetensors", entries, tensors.__getitem__)
    return out


@pytest.mark.parametrize(
    "edit,scale,error,words",
    [
        ({"weight_block_size": [16]}, None, ConfigError, "quantization_config.weight_block_size"),
        ({"fmt": "e5m2"}, None, ConfigError, "quantization_config.fmt"),
        (None, np.ones((10, 1), np.float32), CheckpointError, "kv_b_proj.weight_scale_inv"),
    ],
)
def test_bad_fp8_checkpoints_are_one_line(tmp_path, edit, scale, error, words):
    with pytest.raises(error) as e:
        hf.HFCheckpoint(_copy(tmp_path, edit, scale))
    assert words in str(e.value) and "\n" not in str(e.value)
