#!/usr/bin/env python
"""Regenerate the model-family goldens of tests/golden/hf/: tiny random checkpoints of
Llama 3 / 3.2, Mistral, Qwen2, Qwen3 and Gemma 3 written by transformers itself, and
the logits transformers computes (eager attention, float32) for fixed tokens.

Needs torch + transformers, which the project never installs; use a separate venv
(as for make_hf_goldens.py, which writes the two Llama-2 goldens and stays as it is):

    .venv-golden/bin/python tests/golden/make_hf_family_goldens.py          # writes them
    .venv-golden/bin/python tests/golden/make_hf_family_goldens.py --check OUT LOGITS

`--check` loads OUT (written by `scripts/export.py RUN --hf OUT`) with
`AutoModelForCausalLM.from_pretrained` and prints the max abs difference of its
logits from LOGITS: a golden name, or a .safetensors file holding `tokens` and the
project's `logits` for them (exit 1 above 1e-4).

Every model: vocab 256, hidden 64, 2-3 layers, float32 weights N(0, 0.15) and norm
weights 1 + N(0, 0.1) (Gemma's (1 + w) norms: N(0, 0.1)); tokens 2 x 40, longer than
every sliding window (8) and every original RoPE context (16) below, so both matter:
  llama3        rope llama3 (factor 8, low 1, high 4, original 16), GQA 8/2, untied
  llama32_tied  rope llama3 (factor 32, original 16, theta 5e5), MQA 4/1, tied
  llama_yarn    rope yarn (factor 4, original 16, beta_fast 32, beta_slow 1)
  mistral_swa   sliding_window 8, head_dim 16 with 8 heads (q_proj 128 x 64)
  qwen2         q/k/v biases, rope_theta 1e6, untied
  qwen3         q/k RMSNorm over head_dim 32 (hidden / heads = 16), tied
  gemma3_text   layers sliding/full/sliding (window 8, local base 1e4; global linear
                rope factor 2, base 1e6), head_dim 32, query_pre_attn_scalar 24,
                final softcap 3, gelu_pytorch_tanh, tied (no attention softcap:
                transformers 5.24's Gemma 3 reads attn_logit_softcapping but never
                applies it, so the importer refuses a non-null one)
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "hf"
TOKENS = np.random.RandomState(24).randint(0, 256, size=(2, 40)).astype(np.int64)
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
)
MODELS = {
    "llama3": (
        "DecoderConfig",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama32_tied": (
        "DecoderConfig",
        dict(
            num_attention_heads=4,
            num_key_value_heads=1,
            tie_word_embeddings=True,
            head_dim=16,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 5e5,
                "factor": 32.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 16,
            },
        ),
    ),
    "llama_yarn": (
        "DecoderConfig",
        dict(
            max_position_embeddings=64,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 4.0,
                "original_max_position_embeddings": 16,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
            },
        ),
    ),
    "mistral_swa": (
        "MistralConfig",
        dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=16,
            sliding_window=8,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e4},
        ),
    ),
    "qwen2": (
        "Qwen2Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=False,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    "qwen3": (
        "Qwen3Config",
        dict(
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            tie_word_embeddings=True,
            use_sliding_window=False,
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    "gemma3_text": (
        "Gemma3TextConfig",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            layer_types=["sliding_attention", "full_attention", "sliding_attention"],
            sliding_window=8,
            query_pre_attn_scalar=24,
            final_logit_softcapping=3.0,
            hidden_activation="gelu_pytorch_tanh",
            tie_word_embeddings=True,
            pad_token_id=0,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
            },
        ),
    ),
}


def make_model(name: str):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, kw = MODELS[name]
    cfg = getattr(transformers, cls)(**{**COMMON, **kw})
    torch.manual_seed(sum(map(ord, name)))
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    gemma = cfg.model_type.startswith("gemma")
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_((0 if gemma else 1) + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
        logits = model(torch.from_numpy(TOKENS)).logits.float().numpy()
    return model, logits


def generate() -> None:
    from safetensors.numpy import save_file

    OUT.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        d = OUT / name
        d.mkdir(exist_ok=True)
        for f in d.glob("*"):
            f.unlink()
        model, logits = make_model(name)
        model.save_pretrained(d)
        (d / "generation_config.json").unlink(missing_ok=True)
        save_file(
            {"tokens": TOKENS.astype(np.int32), "logits": logits.astype(np.float32)},
            str(OUT / f"{name}_logits.safetensors"),
        )
        print(f"{d}: {sorted(p.name for p in d.iterdir())}; logits std {logits.std():.3f}")


def check(exported: str, logits: str) -> int:
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    src = Path(logits) if logits.endswith(".safetensors") else OUT / f"{logits}_logits.safetensors"
    want = load_file(str(src))
    model = AutoModelForCausalLM.from_pretrained(exported, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.no_grad():
        got = model(torch.from_numpy(want["tokens"].astype(np.int64))).logits.float().numpy()
    err = float(np.abs(got - want["logits"]).max())
    print(
        f"{exported}: from_pretrained OK ({type(model).__name__}, model_type "
        f"{model.config.model_type}); max |logits - {src.name}| = {err:.3g}"
    )
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", nargs=2, metavar=("EXPORTED_DIR", "LOGITS"))
    args = ap.parse_args()
    sys.exit(check(*args.check) if args.check else generate())
