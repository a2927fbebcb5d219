#!/usr/bin/env python
"""Regenerate tests/golden/hf/deepseek_v3_fp8: the tiny DeepSeek-V3 golden (tests/golden/hf/deepseek_v3,
make_hf_deepseek_goldens.py) stored as DeepSeek-V3 publishes its weights: every 2-D Linear weight
under model.layers (attention, dense MLP, experts, shared experts; not the router `mlp.gate.weight`,
norms, embeddings or head) as float8_e4m3fn with `<name>_scale_inv` float32, one scale per
16 x 16 block (the published checkpoint's blocks are 128 x 128; 16 makes the tiny weights hold
several blocks, partial ones at the edges of the 40- and 96-row weights), and config.json's
`quantization_config: {quant_method: fp8, fmt: e4m3, activation_scheme: dynamic,
weight_block_size: [16, 16]}`. Quantisation as DeepSeek's: per block s = amax / 448,
fp8 = (w / s) in float8_e4m3fn, scale_inv = s.

`deepseek_v3_fp8_logits.safetensors`: tokens (2, 40) int32 and the logits (2, 40, 256) float32 of
transformers' DeepseekV3ForCausalLM (eager, float32) loaded with the dequantised weights
fp8 * scale_inv (computed here in torch, float32), i.e. what the import must reproduce.

Needs torch + transformers (the golden venv, tests/golden/README.md; made with torch 2.13.0 CPU,
transformers 5.25.0):
    VENV/bin/python tests/golden/make_hf_deepseek_fp8_golden.py
"""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

HF = Path(__file__).resolve().parent / "hf"
SRC, NAME = HF / "deepseek_v3", "deepseek_v3_fp8"
BLOCK = 16
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value


def quantize(w):
    """(out, in) float32 tensor -> (float8_e4m3fn tensor, float32 scale_inv (ceil(out/B), ceil(in/B)))."""
    import torch

    o, i = w.shape
    po, pi = -(-o // BLOCK) * BLOCK, -(-i // BLOCK) * BLOCK
    padded = torch.zeros(po, pi).index_put_((torch.arange(o)[:, None], torch.arange(i)[None, :]), w)
    blocks = padded.reshape(po // BLOCK, BLOCK, pi // BLOCK, BLOCK)
    s = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-12) / FP8_MAX  # (G, H)
    q = (blocks / s[:, None, :, None]).reshape(po, pi)[:o, :i].to(torch.float8_e4m3fn)
    return q, s.float()


def dequantize(q, s):
    return q.float() * s.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: q.shape[0], : q.shape[1]]


def quantized_name(name: str, shape) -> bool:
    return name.startswith("model.layers.") and name.endswith("proj.weight") and len(shape) == 2


def main() -> None:
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import AutoModelForCausalLM

    out = HF / NAME
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir()
    tensors = load_file(str(SRC / "model.safetensors"))
    stored, plain = {}, {}
    for name, w in tensors.items():
        if quantized_name(name, w.shape):
            q, s = quantize(w.float())
            stored[name], stored[name + "_scale_inv"] = q, s
            plain[name] = dequantize(q, s)
        else:
            stored[name] = plain[name] = w
    save_file(stored, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((SRC / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [BLOCK, BLOCK],
    }
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    with tempfile.TemporaryDirectory() as tmp:  # the dequantised weights as a plain checkpoint
        shutil.copy(SRC / "config.json", tmp)
        save_file({k: v.contiguous() for k, v in plain.items()}, str(Path(tmp) / "model.safetensors"), {"format": "pt"})
        model = AutoModelForCausalLM.from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        ).eval()
    tokens = load_file(str(HF / "deepseek_v3_logits.safetensors"))["tokens"]
    with torch.no_grad():
        logits = model(tokens.long()).logits.float()
    save_file({"tokens": tokens, "logits": logits.contiguous()}, str(HF / f"{NAME}_logits.safetensors"))
    n_fp8 = sum(1 for n in stored if n.endswith("_scale_inv"))
    err = max(float((plain[n] - tensors[n].float()).abs().max()) for n in plain if n in tensors)
    print(f"{NAME}: {n_fp8} FP8 weights, max |dequantised - original| {err:.3g}, logits std {float(logits.std()):.3g}")


if __name__ == "__main__":
    main()
