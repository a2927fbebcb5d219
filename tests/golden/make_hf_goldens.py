#!/usr/bin/env python
"""Regenerate tests/golden/hf/: tiny random Hugging Face Llama checkpoints and the
logits transformers' own LlamaForCausalLM computes for fixed tokens.

Needs torch + transformers, which the project never installs; use a separate venv:

    .venv-golden/bin/python tests/golden/make_hf_goldens.py            # writes tests/golden/hf
    .venv-golden/bin/python tests/golden/make_hf_goldens.py --check EXPORTED_DIR GOLDEN_NAME

(`.venv-golden`: the golden venv at the checkout's root, tests/golden/README.md.)

`--check` loads a directory written by `scripts/export.py RUN --hf OUT` with
`LlamaForCausalLM.from_pretrained` and prints the max abs difference of its logits
from the golden ones (for an exported, untrained import of that golden model: 0).

Two models (vocab 256, d_model 64, 2 layers, SwiGLU 128):
  llama_gqa   8 query / 2 kv heads, untied head, rope_theta 10000, eps 1e-5,
              bfloat16 weights saved as a sharded checkpoint (index + 3 files),
              plus a 256-token BPE tokenizer.json trained on a few stdlib files
  llama_tied  4 query / 1 kv head (MQA), tied embeddings, rope_theta 5e5, eps 1e-6,
              float16 weights in 3 shards (no file over tens of KB; the single-file
              layout is covered by exports, tests/test_hf.py)
(BPE training may order equal-count merges differently from run to run, so a
regenerated tokenizer.json can differ in a few merges; no test depends on its ids.)
Weights are drawn at float32, rounded to the stored dtype, and the logits are
computed in float32 from the rounded values, so an exact importer matches them to
float32 rounding. Weights are N(0, 0.15) and norm scales 1 + N(0, 0.1), so logits
have std ~1 and a wrong transpose or head order shows.
"""

from __future__ import annotations

import argparse
import json
import sys
import sysconfig
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "hf"
TOKENS = np.array(
    [
        [1, 17, 42, 99, 3, 250, 7, 7, 128, 64, 32, 5, 201, 13, 77, 2],
        [255, 0, 9, 18, 27, 36, 45, 54, 63, 72, 81, 90, 99, 108, 117, 126],
    ],
    np.int64,
)
MODELS = {
    "llama_gqa": dict(
        kwargs=dict(
            num_attention_heads=8,
            num_key_value_heads=2,
            rope_theta=10000.0,
            rms_norm_eps=1e-5,
            tie_word_embeddings=False,
        ),
        dtype="bfloat16",
        max_shard_size="40KB",
        tokenizer=True,
    ),
    "llama_tied": dict(
        kwargs=dict(
            num_attention_heads=4, num_key_value_heads=1, rope_theta=5e5, rms_norm_eps=1e-6, tie_word_embeddings=True
        ),
        dtype="float16",
        max_shard_size="60KB",
        tokenizer=False,
    ),
}
TOKENIZER_FILES = ("textwrap.py", "string.py", "bisect.py", "heapq.py", "keyword.py")


def make_model(name: str, spec: dict):
    import torch
    from transformers import DecoderConfig, LlamaForCausalLM

    kw = dict(spec["kwargs"])
    theta = kw.pop("rope_theta")
    cfg = DecoderConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        max_position_embeddings=64,
        hidden_act="silu",
        bos_token_id=1,
        eos_token_id=2,
        rope_parameters={"rope_type": "default", "rope_theta": theta},
        **kw,
    )
    torch.manual_seed(sum(map(ord, name)))
    model = LlamaForCausalLM(cfg).eval()
    store = getattr(torch, spec["dtype"])
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
            p.copy_(p.to(store).to(torch.float32))  # representable in the stored dtype
        logits = model(torch.from_numpy(TOKENS)).logits.float().numpy()
    return model, store, logits


def train_tokenizer(out: Path) -> None:
    """A 256-token BPE (SentencePiece-style Metaspace pre-tokenizer, <unk>/<s>/</s>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(
        vocab_size=256, special_tokens=["<unk>", "<s>", "</s>"], limit_alphabet=96, show_progress=False
    )
    root = Path(sysconfig.get_paths()["stdlib"])
    tok.train([str(root / f) for f in TOKENIZER_FILES], trainer)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=2) + "\n"
    )


def generate() -> None:
    from safetensors.numpy import save_file

    OUT.mkdir(parents=True, exist_ok=True)
    for name, spec in MODELS.items():
        d = OUT / name
        for f in d.glob("*"):
            f.unlink()
        model, store, logits = make_model(name, spec)
        model.to(store).save_pretrained(d, max_shard_size=spec["max_shard_size"])
        for extra in ("generation_config.json",):
            (d / extra).unlink(missing_ok=True)
        if spec["tokenizer"]:
            train_tokenizer(d)
        save_file(
            {"tokens": TOKENS.astype(np.int32), "logits": logits.astype(np.float32)},
            str(OUT / f"{name}_logits.safetensors"),
        )
        print(f"{d}: {sorted(p.name for p in d.iterdir())}; logits std {logits.std():.3f}")


def check(exported: str, golden: str) -> int:
    import torch
    from safetensors.numpy import load_file
    from transformers import LlamaForCausalLM

    want = load_file(str(OUT / f"{golden}_logits.safetensors"))
    model = LlamaForCausalLM.from_pretrained(exported, dtype=torch.float32).eval()
    with torch.no_grad():
        got = model(torch.from_numpy(want["tokens"].astype(np.int64))).logits.float().numpy()
    err = float(np.abs(got - want["logits"]).max())
    print(
        f"{exported}: from_pretrained OK ({type(model).__name__}, tied="
        f"{model.config.tie_word_embeddings}); max |logits - golden {golden}| = {err:.3g}"
    )
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", nargs=2, metavar=("EXPORTED_DIR", "GOLDEN_NAME"))
    args = ap.parse_args()
    sys.exit(check(*args.check) if args.check else generate())
