#!/usr/bin/env python
"""Regenerate the DeepSeek-V3 golden of tests/golden/hf/: a tiny random DeepseekV3ForCausalLM
written by transformers itself, the logits it computes (eager attention, eager experts loop,
float32) for fixed tokens, and its router logits.

Needs torch + transformers, which the project never installs; run it in the golden venv
(tests/golden/README.md; made with Python 3.11, torch CPU, transformers 5.25.0):

    VENV/bin/python tests/golden/make_hf_deepseek_goldens.py          # writes it
    VENV/bin/python tests/golden/make_hf_deepseek_goldens.py --check OUT LOGITS

`--check` loads OUT with `AutoModelForCausalLM.from_pretrained` and prints the max abs
difference of its logits from LOGITS (a golden name or a .safetensors file holding `tokens`
and `logits`); exit 1 above 1e-4.

deepseek_v3 (DeepseekV3Config): vocab 256, hidden 64, 3 layers, first_k_dense_replace 1
(layer 0 a dense MLP of intermediate 96, layers 1 and 2 mixtures of experts), 4 heads;
multi-head latent attention with q_lora_rank 48, kv_lora_rank 32, qk_nope_head_dim 16,
qk_rope_head_dim 8, v_head_dim 24, rope_interleave true; YaRN (factor 4, original context 16,
mscale 1, mscale_all_dim 1: the softmax scale times mscale(4, 1)^2); 8 routed experts of
intermediate 32 in 4 groups, topk_group 2, top-2, sigmoid scores plus e_score_correction_bias,
norm_topk_prob, routed_scaling_factor 2.5; 1 shared expert (intermediate 32); num_mtp_layers 0;
untied head, rms_norm_eps 1e-6. Tokens 2 x 40 from RandomState(24).

Weights N(0, 0.15); norm weights 1 + N(0, 0.1); router weight N(0, 0.5); e_score_correction_bias
N(0, 0.1). Routing must be decisive: the torch seed is sum(map(ord, name)) + attempt, the first
attempt where, for every token of every sparse layer, the topk_group-th and next group scores
and the k-th and next choice scores (within the chosen groups) differ by > 1e-3.

Tensors of a sparse layer as transformers saves them (per expert, its conversion of the fused
in-memory experts): mlp.gate.weight (8, 64), mlp.gate.e_score_correction_bias (8,),
mlp.experts.{e}.{gate,up,down}_proj.weight, mlp.shared_experts.{gate,up,down}_proj.weight;
attention: self_attn.q_a_proj.weight (48, 64), q_a_layernorm.weight (48,), q_b_proj.weight
(96, 48), kv_a_proj_with_mqa.weight (40, 64), kv_a_layernorm.weight (32,), kv_b_proj.weight
(160, 32), o_proj.weight (64, 96).

Logits file `deepseek_v3_logits.safetensors`: tokens (2, 40) int32, logits (2, 40, 256) f32,
router_logits_<i> (80, 8) f32 for sparse layers 1 and 2 (before the sigmoid).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "hf"
TOKENS = np.random.RandomState(24).randint(0, 256, size=(2, 40)).astype(np.int64)
MIN_GAP = 1e-3
NAME = "deepseek_v3"
CONFIG = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=4,
    n_shared_experts=1,
    n_routed_experts=8,
    routed_scaling_factor=2.5,
    kv_lora_rank=32,
    q_lora_rank=48,
    qk_rope_head_dim=8,
    v_head_dim=24,
    qk_nope_head_dim=16,
    n_group=4,
    topk_group=2,
    num_experts_per_tok=2,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    rope_interleave=True,
    num_mtp_layers=0,
    rope_parameters={
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 16,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
    },
    bos_token_id=1,
    eos_token_id=2,
)


def make_model(attempt: int):
    import torch
    from transformers import AutoModelForCausalLM, DeepseekV3Config

    torch.manual_seed(sum(map(ord, NAME)) + attempt)
    model = AutoModelForCausalLM.from_config(
        DeepseekV3Config(**CONFIG), attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith(("norm.weight", "layernorm.weight")):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):
                p.normal_(0, 0.5)
            else:
                p.normal_(0, 0.15)
        for bname, b in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                b.copy_(0.1 * torch.randn_like(b))
    return model


def gap(model, router_logits) -> float:
    """The smallest group-choice and expert-choice margin over tokens and sparse layers."""
    cfg = model.config
    e, g, tg, k = cfg.n_routed_experts, cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok
    biases = [b.numpy() for n, b in model.named_buffers() if n.endswith("e_score_correction_bias")]
    out = float("inf")
    for rl, bias in zip(router_logits, biases):
        choice = 1 / (1 + np.exp(-rl.double().numpy())) + bias
        gs = np.sort(choice.reshape(-1, g, e // g), -1)[..., -2:].sum(-1)  # (N, G): top-2 sums
        ranked = np.sort(gs, -1)[:, ::-1]
        out = min(out, float((ranked[:, tg - 1] - ranked[:, tg]).min()))
        keep = np.argsort(-gs, -1)[:, :tg]
        masked = np.full_like(choice, -np.inf)
        for t in range(len(choice)):
            for j in keep[t]:
                masked[t, j * (e // g) : (j + 1) * (e // g)] = choice[t, j * (e // g) : (j + 1) * (e // g)]
        s = np.sort(masked, -1)[:, ::-1]
        out = min(out, float((s[:, k - 1] - s[:, k]).min()))
    return out


def run(model):
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(TOKENS), output_router_logits=True)


def generate() -> int:
    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    d = OUT / NAME
    d.mkdir(parents=True, exist_ok=True)
    for f in d.glob("*"):
        f.unlink()
    for attempt in range(200):
        model = make_model(attempt)
        out = run(model)
        margin = gap(model, out.router_logits)
        if margin > MIN_GAP:
            break
    model.save_pretrained(d)
    (d / "generation_config.json").unlink(missing_ok=True)
    f32 = lambda t: t.float().numpy().astype(np.float32)  # noqa: E731
    arrays = {"tokens": TOKENS.astype(np.int32), "logits": f32(out.logits)}
    sparse = list(range(model.config.first_k_dense_replace, model.config.num_hidden_layers))
    assert len(out.router_logits) == len(sparse)
    for i, rl in zip(sparse, out.router_logits):
        arrays[f"router_logits_{i}"] = f32(rl)
    save_file(arrays, str(OUT / f"{NAME}_logits.safetensors"))
    back = AutoModelForCausalLM.from_pretrained(
        d, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    err = float(np.abs(f32(run(back).logits) - arrays["logits"]).max())
    assert err == 0.0, f"reloaded logits differ by {err}"
    print(
        f"{NAME}: {sorted(p.name for p in d.iterdir())}, {(d / 'model.safetensors').stat().st_size} B; "
        f"seed attempt {attempt}; min routing margin {margin:.3g}; logits std {arrays['logits'].std():.3f}; "
        "reload bit-identical"
    )
    return 0


def check(exported: str, logits: str) -> int:
    import torch
    from safetensors.numpy import load_file
    from transformers import AutoModelForCausalLM

    src = Path(logits) if logits.endswith(".safetensors") else OUT / f"{logits}_logits.safetensors"
    want = load_file(str(src))
    model = AutoModelForCausalLM.from_pretrained(
        exported, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
    ).eval()
    with torch.no_grad():
        out = model(torch.from_numpy(want["tokens"].astype(np.int64)))
    err = float(np.abs(out.logits.float().numpy() - want["logits"]).max())
    print(
        f"{exported}: from_pretrained OK ({type(model).__name__}, model_type {model.config.model_type}); "
        f"max |logits - {src.name}| = {err:.3g}"
    )
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", nargs=2, metavar=("EXPORTED_DIR", "LOGITS"))
    args = ap.parse_args()
    sys.exit(check(*args.check) if args.check else generate())
