#!/usr/bin/env python
"""Regenerate the gpt-oss goldens of tests/golden/hf/: tiny random GptOssForCausalLMs written
by transformers itself, the logits it computes (eager attention, eager experts loop, float32)
for fixed tokens, its router logits and load-balancing aux loss.

Needs torch + transformers, which the project never installs; run it in the golden venv
(tests/golden/README.md; these were made with Python 3.11, torch CPU, transformers 5.25.0):

    VENV/bin/python tests/golden/make_hf_gpt_oss_goldens.py          # writes them
    VENV/bin/python tests/golden/make_hf_gpt_oss_goldens.py --check OUT LOGITS

`--check` loads OUT (e.g. written by `scripts/export.py RUN --hf OUT`) with
`AutoModelForCausalLM.from_pretrained` and prints the max abs difference of its logits
(and aux loss, when LOGITS holds one) from LOGITS: a golden name, or a .safetensors file
holding `tokens` and the project's `logits` for them (exit 1 above 1e-4).

The model (GptOssConfig, everything gpt-oss has, small): vocab 256, hidden 96, 4 layers
alternating sliding_attention / full_attention (layer_types), sliding_window 8, 4 q / 2 kv
heads of head_dim 16, q/k/v/o biases (attention_bias), a learned sink logit per head, every
layer a mixture of 4 experts, top-2, intermediate 32, router with a bias, experts with biases
and the clamped SwiGLU (swiglu_limit 1.0, small enough that the clamps act on many entries;
swiglu_alpha 1.702), YaRN RoPE (factor 4, original context 16, beta_fast 32, beta_slow 1,
truncate false), rms_norm_eps 1e-5, untied head, router_aux_loss_coef 0.02. Tokens 2 x 40
from RandomState(24): past the window and the original RoPE context.

Weights: N(0, 0.15); norm weights 1 + N(0, 0.1); sinks N(0, 1) (so they move the softmax);
router weight N(0, 0.25) and bias N(0, 0.25). Routing must be decisive (float rounding cannot
flip a top-k choice): the torch seed is sum(map(ord, name)) + attempt, the first attempt whose
gap between the k-th and (k+1)-th router logit is > 1e-2 over every token of every layer.

Goldens:
  gpt_oss        float32 weights as transformers saves them: per layer
                   self_attn.{q,k,v,o}_proj.{weight,bias}, self_attn.sinks (4,),
                   mlp.router.weight (4, 96), mlp.router.bias (4,),
                   mlp.experts.gate_up_proj (4, 96, 64) (in, out; gate and up INTERLEAVED on the
                   last dim: gate = [..., ::2], up = [..., 1::2]), mlp.experts.gate_up_proj_bias
                   (4, 64), mlp.experts.down_proj (4, 32, 96), mlp.experts.down_proj_bias (4, 96),
                   {input,post_attention}_layernorm.weight
  gpt_oss_mxfp4  the same architecture (another seed) with its experts' gate_up_proj and
                 down_proj stored as OpenAI's MXFP4 checkpoints store them (what transformers'
                 integrations/mxfp4.py reads): `<proj>_blocks` uint8 (E, out, in/32, 16), two
                 FP4 (e2m1) codes per byte, low nibble first, and `<proj>_scales` uint8
                 (E, out, in/32), a power of two 2**(s - 127) per block of 32; config.json
                 carries quantization_config {quant_method: mxfp4}. This script draws random
                 codes and scales (s in 122..127), writes the file itself (transformers cannot
                 quantize on a CPU), and transformers loads it with Mxfp4Config(dequantize=True):
                 the logits are those of transformers' own dequantisation.

Logits file `<name>_logits.safetensors`: tokens (2, 40) int32, logits (2, 40, 256) f32,
router_logits_<i> (80, 4) f32 per layer (bias included, before the top-k), aux_loss ().
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "hf"
TOKENS = np.random.RandomState(24).randint(0, 256, size=(2, 40)).astype(np.int64)
MIN_LOGIT_GAP = 1e-2
CONFIG = dict(
    vocab_size=256,
    hidden_size=96,
    intermediate_size=32,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    num_local_experts=4,
    num_experts_per_tok=2,
    sliding_window=8,
    layer_types=["sliding_attention", "full_attention"] * 2,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    tie_word_embeddings=False,
    attention_bias=True,
    swiglu_limit=1.0,
    router_aux_loss_coef=0.02,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 16,
    },
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
NAMES = ("gpt_oss", "gpt_oss_mxfp4")


def make_model(name: str, attempt: int):
    import torch
    from transformers import AutoModelForCausalLM, GptOssConfig

    torch.manual_seed(sum(map(ord, name)) + attempt)
    model = AutoModelForCausalLM.from_config(
        GptOssConfig(**CONFIG), attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname.endswith("sinks"):
                p.normal_(0, 1.0)
            elif ".router." in pname:
                p.normal_(0, 0.25)
            else:
                p.normal_(0, 0.15)
    return model


def run(model):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(TOKENS), output_router_logits=True)


def goldens(model):
    """The stored arrays and the smallest router logit gap; None where routing is not decisive."""
    out = run(model)
    k = model.config.num_experts_per_tok
    gap = _gap(out.router_logits, k)
    if gap <= MIN_LOGIT_GAP:
        return None
    f32 = lambda t: t.float().numpy().astype(np.float32)  # noqa: E731
    arrays = {"tokens": TOKENS.astype(np.int32), "logits": f32(out.logits), "aux_loss": f32(out.aux_loss)}
    for i, rl in enumerate(out.router_logits):
        arrays[f"router_logits_{i}"] = f32(rl)
    return arrays, gap


def _gap(router_logits, k: int) -> float:
    gap = float("inf")
    for rl in router_logits:
        s = rl.float().sort(dim=-1, descending=True).values
        gap = min(gap, float((s[:, k - 1] - s[:, k]).min()))
    return gap


FP4 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def mxfp4_dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """(E, out, in/32, 16) uint8 codes + (E, out, in/32) uint8 exponents -> (E, in, out) f32."""
    lo, hi = FP4[blocks & 0x0F], FP4[blocks >> 4]
    vals = np.stack([lo, hi], axis=-1).reshape(*blocks.shape[:-1], 32)
    vals = vals * np.exp2(scales.astype(np.float32) - 127)[..., None]
    return vals.reshape(*blocks.shape[:2], -1).transpose(0, 2, 1)


def write_mxfp4(model, d: Path, rng: np.random.RandomState) -> None:
    """Replace d's expert weights by random MXFP4 blocks/scales and say so in config.json."""
    import torch
    from safetensors.numpy import load_file, save_file

    state = load_file(str(d / "model.safetensors"))
    for key in [k for k in state if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        e, i, o = state.pop(key).shape
        blocks = rng.randint(0, 256, size=(e, o, i // 32, 16)).astype(np.uint8)
        scales = rng.randint(120, 124, size=(e, o, i // 32)).astype(np.uint8)
        state[key + "_blocks"], state[key + "_scales"] = blocks, scales
        with torch.no_grad():  # the model in memory holds the same values (for the routing search)
            dict(model.named_parameters())[key].copy_(torch.from_numpy(mxfp4_dequantize(blocks, scales)))
    save_file(state, str(d / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((d / "config.json").read_text())
    cfg["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
    }
    (d / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def load(d: Path, quantized: bool):
    import torch
    from transformers import AutoModelForCausalLM, Mxfp4Config

    kw = {"quantization_config": Mxfp4Config(dequantize=True)} if quantized else {}
    return AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager", **kw
    ).eval()


def generate() -> int:
    from safetensors.numpy import save_file

    OUT.mkdir(parents=True, exist_ok=True)
    for name in NAMES:
        quantized = name.endswith("mxfp4")
        d = OUT / name
        d.mkdir(exist_ok=True)
        for f in d.glob("*"):
            f.unlink()
        for attempt in range(100):
            model = make_model(name, attempt)
            if quantized:
                model.save_pretrained(d)
                write_mxfp4(model, d, np.random.RandomState(attempt))
            if goldens(model) is not None:
                break
        if not quantized:
            model.save_pretrained(d)
        (d / "generation_config.json").unlink(missing_ok=True)
        back = load(d, quantized)
        got = goldens(back)
        assert got is not None, f"{name}: routing of the reloaded model is not decisive"
        arrays, gap = got
        want, _ = goldens(model)
        err = float(np.abs(arrays["logits"] - want["logits"]).max())
        assert err < 1e-5, f"{name}: reloaded logits differ by {err}"
        save_file(arrays, str(OUT / f"{name}_logits.safetensors"))
        print(
            f"{name}: {sorted(p.name for p in d.iterdir())}, {(d / 'model.safetensors').stat().st_size} B; "
            f"seed attempt {attempt}; min router logit gap {gap:.3g}; aux_loss {float(arrays['aux_loss']):.6f}; "
            f"logits std {arrays['logits'].std():.3f}; reload within {err:.2g} of the model in memory"
        )
    return 0


def check(exported: str, logits: str) -> int:
    import torch
    from safetensors.numpy import load_file

    src = Path(logits) if logits.endswith(".safetensors") else OUT / f"{logits}_logits.safetensors"
    want = load_file(str(src))
    model = load(Path(exported), quantized=False)
    with torch.no_grad():
        out = model(torch.from_numpy(want["tokens"].astype(np.int64)), output_router_logits=True)
    err = float(np.abs(out.logits.float().numpy() - want["logits"]).max())
    msg = (
        f"{exported}: from_pretrained OK ({type(model).__name__}, model_type "
        f"{model.config.model_type}); max |logits - {src.name}| = {err:.3g}"
    )
    if "aux_loss" in want:
        aux_err = abs(float(out.aux_loss) - float(want["aux_loss"]))
        msg += f"; |aux_loss - stored| = {aux_err:.3g}"
        err = max(err, aux_err)
    print(msg)
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", nargs=2, metavar=("EXPORTED_DIR", "LOGITS"))
    args = ap.parse_args()
    sys.exit(check(*args.check) if args.check else generate())
