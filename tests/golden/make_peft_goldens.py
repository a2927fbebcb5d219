#!/usr/bin/env python
"""Regenerate the LoRA goldens of tests/golden/peft/: Hugging Face PEFT adapters, written
by peft itself, on the model-family goldens of tests/golden/hf/, and the logits the
adapted models compute (eager attention, float32) for the same fixed tokens.

Needs torch + transformers + peft, which the project never installs; use a separate venv
outside the repository, as for make_hf_family_goldens.py (these were made with Python
3.11, torch 2.13.0 CPU, transformers 5.24.0, peft 0.21.2, safetensors 0.8.0, numpy 2.4):

    python3.11 -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==5.24.0 peft safetensors numpy
    VENV/bin/python tests/golden/make_peft_goldens.py          # writes them
    VENV/bin/python tests/golden/make_peft_goldens.py --check-peft BASE_NAME ADAPTER_DIR LOGITS

`--check-peft` loads the base golden tests/golden/hf/BASE_NAME, applies ADAPTER_DIR (e.g.
an adapter the project wrote) with `PeftModel.from_pretrained(base, ADAPTER_DIR)` and
prints the max abs difference of its logits from LOGITS: a golden name (llama3_rslora
...), or a .safetensors file holding `tokens` and `logits` (exit 1 above 1e-4). A merged
export (a plain HF checkpoint) is checked by make_hf_family_goldens.py --check OUT
tests/golden/peft/<name>_logits.safetensors, whose `logits` are the adapted model's.

Adapters (base loaded with AutoModelForCausalLM.from_pretrained(tests/golden/hf/BASE),
float32, eager; torch seed sum(map(ord, "lora:" + name)) before get_peft_model):
  llama3, llama32_tied, mistral_swa, qwen2, qwen3, gemma3_text
      LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, init_lora_weights=False,
      target_modules=[q_proj, k_proj, v_proj, o_proj, gate_proj, up_proj, down_proj],
      task_type=CAUSAL_LM): scaling alpha / r = 2
  mixtral, qwen3_moe (mixture of experts; every layer sparse)
      r=4, lora_alpha=8, target_modules q_proj k_proj v_proj o_proj and
      target_parameters [mlp.experts.gate_up_proj, mlp.experts.down_proj] (peft's
      ParamWrapper on transformers' fused expert tensors, nested in that order: keys
      mlp.experts.base_layer.lora_{A,B}.weight for gate_up_proj, mlp.experts.lora_{A,B}.weight
      for down_proj; lora_A (r * E, in) rows expert-major, lora_B (out, r * E) columns
      rank-major: delta_e = B.reshape(out, r, E)[..., e] @ A.reshape(E, r, in)[e])
  qwen2_moe (3 layers: 0 and 2 dense, 1 sparse with a shared expert)
      r=4, lora_alpha=8, target_modules the seven and shared_expert_gate, target_parameters
      as above: peft wraps layers 0 and 2's mlp.{gate,up,down}_proj, layer 1's
      mlp.shared_expert.{gate,up,down}_proj and mlp.shared_expert_gate (lora_B (1, r)),
      and layer 1's fused experts (keys as mixtral's). transformers 5.24 has no v4 -> v5
      conversion for model_type qwen2_moe, so peft 0.21.2 keeps these names as they are
      (for qwen3_moe it rewrites target_modules gate/up/down_proj to the fused experts at
      rank 2r via rank_pattern, and a Qwen3-MoE dense layer's MLP cannot be targeted).
      "all-linear" on Qwen2-MoE gives the same modules (every nn.Linear but lm_head: its
      router is a custom module, not adapted); the routed experts only by target_parameters.
  qwen2_moe_shared (base qwen2_moe)
      r=4, lora_alpha=8, target_modules the seven, no target_parameters: dense layers and
      the shared expert only (PEFT's meaning of those names on Qwen2-MoE)
  deepseek_v3 (3 layers, latent attention with q_lora_rank 48, kv_lora_rank 32; made with
      transformers 5.25.0, peft 0.21.2: DeepseekV3ForCausalLM is new in 5.25)
      r=4, lora_alpha=8, target_modules q_a_proj q_b_proj kv_a_proj_with_mqa kv_b_proj o_proj
      (latent attention's nn.Linear projections, every layer) and target_parameters
      mlp.{gate,up,down}_proj.weight (layer 0, dense) and mlp.shared_experts.{gate,up,down}_proj.weight
      (layers 1, 2): a ParamWrapper on each nn.Linear weight, whose tensors are named as a Linear's
      adapter (mlp.gate_proj.lora_A.weight (r, in) ...); and the routed experts by
      mlp.experts.gate_up_proj / down_proj (as mixtral's, rank r: named as target_parameters, they
      take no rank_pattern). Why not
      target_modules gate_proj ...: peft 0.21.2 on transformers 5.25 applies Qwen2-MoE's v4 -> v5
      conversion to DeepseekV3 and rewrites target_modules gate_proj / up_proj / down_proj (any
      name ending so, a regex's matches, and all-linear's) to target_parameters on the fused
      routed experts (gate_up_proj at rank 2r, alpha 2 alpha, by rank_pattern / alpha_pattern);
      all-linear becomes the five attention projections + the fused experts + the router
      (mlp.gate.weight): no dense MLP or shared expert is adapted by target_modules
  deepseek_v3_rewritten (base deepseek_v3; transformers 5.25.0, peft 0.21.2)
      r=4, lora_alpha=8, target_modules the five attention names + gate_proj up_proj down_proj, as a
      PEFT user writes them: peft saves target_modules the five, target_parameters [gate_up_proj,
      down_proj], rank_pattern {.*\\.gate_up_proj: 8}, alpha_pattern {.*\\.gate_up_proj: 16}
      (gate_up's lora_A (8 * E, D), lora_B (2F, 8 * E); down_proj's at r 4)
  qwen3_moe_rewritten (base qwen3_moe; transformers 5.25.0, peft 0.21.2)
      r=4, lora_alpha=8, the seven target_modules: peft saves target_modules q/k/v/o_proj,
      target_parameters [gate_up_proj, down_proj] and deepseek_v3_rewritten's patterns
  deepseek_v3_all_linear (base deepseek_v3; transformers 5.25.0, peft 0.21.2)
      r=4, lora_alpha=8, target_modules all-linear: peft saves target_modules the five,
      target_parameters [down_proj, gate_up_proj, gate.weight] (the router: mlp.gate.lora_A (r, D),
      lora_B (E, r)) and deepseek_v3_rewritten's patterns
  gpt_oss_experts (base gpt_oss; transformers 5.25.0, peft 0.21.2)
      r=4, lora_alpha=8, target_modules q_proj k_proj v_proj o_proj, target_parameters
      [mlp.experts.gate_up_proj, mlp.experts.down_proj]: GptOssExperts is `is_transposed`
      ((E, D, 2F) and (E, F, D), in before out), no rank_pattern; keys and factor layout as
      mixtral's (lora_A (r * E, in), lora_B (out, r * E)), gate_up_proj's B rows in its own
      interleaved gate / up column order
  llama3_rslora (base llama3)
      r=8, lora_alpha=16, use_rslora=True, targets q_proj, v_proj only: scaling
      alpha / sqrt(r) = 16 / sqrt(8) = 5.657
The seven target names are the same in all six families (Gemma 3's MLP and Qwen's
attention use them too; Qwen3's q_norm/k_norm and Gemma's extra norms are not Linear
and not targeted; tied embeddings are not targeted). init_lora_weights=False leaves
both A and B at nn.Linear's default init, kaiming_uniform(a=sqrt(5)), i.e. U(-1/sqrt(in),
1/sqrt(in)): A (r, in) ~ U(+-1/sqrt(in)), B (out, r) ~ U(+-1/sqrt(r)), so B != 0.
Adapted forward: y = W x (+ b) + scaling * B (A x); merged: W' = W + scaling * B @ A.

Files per adapter:
  peft/<name>/adapter_config.json, peft/<name>/adapter_model.safetensors (float32),
  peft/<name>_logits.safetensors: tokens (2, 40) int32, logits (2, 40, 256) float32 of
  the adapted model, merged_logits (2, 40, 256) after merge_and_unload() (equal to
  logits up to float rounding; generation asserts < 1e-4; seen: 6e-6 to 1.2e-5, as the
  adapters move the logits by up to 4-7). The base alone's logits are those of
  tests/golden/hf/<base>_logits.safetensors: generation recomputes them and asserts
  within 1e-5 (reloading those goldens on torch 2.13.0 CPU gives differences up to
  3.8e-6 for llama3, 2.4e-7 for gemma3_text, 0 for the others).
adapter_model.safetensors keys, as peft 0.21 writes them (the adapter name "default"
dropped; the "base_model.model." prefix is PeftModel -> LoraModel -> the HF model, so the
HF module path "model.layers.N..." follows it; Gemma3ForCausalLM's is the same), nn.Linear
(out, in) orientation, e.g. llama3 (hidden 64, 8 heads x 8, 2 kv heads, MLP 128):
  base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight     (4, 64)   (r, in)
  base_model.model.model.layers.0.self_attn.q_proj.lora_B.weight     (64, 4)   (out, r)
  base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight     (4, 64)
  base_model.model.model.layers.0.self_attn.k_proj.lora_B.weight     (16, 4)
  base_model.model.model.layers.0.self_attn.v_proj.lora_{A,B}.weight (4, 64), (16, 4)
  base_model.model.model.layers.0.self_attn.o_proj.lora_{A,B}.weight (4, 64), (64, 4)
  base_model.model.model.layers.0.mlp.gate_proj.lora_{A,B}.weight    (4, 64), (128, 4)
  base_model.model.model.layers.0.mlp.up_proj.lora_{A,B}.weight      (4, 64), (128, 4)
  base_model.model.model.layers.0.mlp.down_proj.lora_{A,B}.weight    (4, 128), (64, 4)
  (14 tensors a layer, 28 for 2 layers; no bias tensors: bias="none", lora_bias False;
  llama3_rslora: q_proj/v_proj only, lora_A (8, 64), lora_B (64, 8) / (16, 8): 8 tensors)
adapter_config.json fields that matter for loading / applying:
  peft_type "LORA", task_type "CAUSAL_LM", r, lora_alpha, use_rslora (scaling alpha/r or
  alpha/sqrt(r)), target_modules (peft writes it as a list, in set order, not sorted
  consistently), fan_in_fan_out false (weights are (out, in); true only for GPT-2 Conv1D),
  bias "none", modules_to_save null, rank_pattern / alpha_pattern {} (per-module r and
  alpha overrides), use_dora false, lora_dropout 0.0 (training only), layers_to_transform
  null, exclude_modules null; init_lora_weights false only says how it was initialised.
  base_model_name_or_path is rewritten from peft's absolute local path to the golden's
  repository path ("tests/golden/hf/<base>"): PeftModel.from_pretrained(base, dir) does
  not read it.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent
HF = ROOT / "hf"
OUT = ROOT / "peft"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
MLA = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]
EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
DEEPSEEK_MLPS = [f"mlp.{s}{p}_proj.weight" for s in ("", "shared_experts.") for p in ("gate", "up", "down")]
COMMON = dict(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=ALL, init_lora_weights=False)
ADAPTERS = {
    "llama3": ("llama3", COMMON),
    "llama32_tied": ("llama32_tied", COMMON),
    "mistral_swa": ("mistral_swa", COMMON),
    "qwen2": ("qwen2", COMMON),
    "qwen3": ("qwen3", COMMON),
    "gemma3_text": ("gemma3_text", COMMON),
    # mixture of experts: PEFT's LoRA on transformers' fused expert tensors (target_parameters;
    # gate and up share one adapter on gate_up_proj (E, 2F, D), its B rows gate first)
    "mixtral": ("mixtral", {**COMMON, "target_modules": ALL[:4], "target_parameters": EXPERTS}),
    "qwen3_moe": ("qwen3_moe", {**COMMON, "target_modules": ALL[:4], "target_parameters": EXPERTS}),
    # Qwen3-MoE with the seven names as a PEFT user writes them: peft 0.21 rewrites the MLP names to the fused
    # experts (gate_up_proj at rank 2r / alpha 2 alpha by rank_pattern / alpha_pattern, down_proj at r)
    "qwen3_moe_rewritten": ("qwen3_moe", COMMON),
    # Qwen2-MoE: target_modules gate/up/down_proj wrap its dense layers' MLPs and its shared
    # expert (nn.Linear), shared_expert_gate the shared expert's (1, D) gate; the routed
    # experts through target_parameters. _shared: the same without them (the 7 names alone)
    "qwen2_moe": (
        "qwen2_moe",
        {**COMMON, "target_modules": ALL + ["shared_expert_gate"], "target_parameters": EXPERTS},
    ),
    "qwen2_moe_shared": ("qwen2_moe", COMMON),
    # gpt-oss: its attention projections are nn.Linear (with biases); its experts are fused
    # parameters with biases, which the project does not adapt
    "gpt_oss": ("gpt_oss", {**COMMON, "target_modules": ALL[:4]}),
    # gpt-oss's experts through target_parameters (its fused tensors are (E, in, out), gate / up
    # interleaved in gate_up_proj's columns; PEFT's factors as Mixtral's)
    "gpt_oss_experts": ("gpt_oss", {**COMMON, "target_modules": ALL[:4], "target_parameters": EXPERTS}),
    # DeepSeek-V3: LoRA on multi-head latent attention's five nn.Linear projections, and on the
    # dense layers' MLPs and the shared experts as target_parameters (see the docstring)
    # and its routed experts by their fused tensors' names (explicit target_parameters: no rank_pattern)
    "deepseek_v3": ("deepseek_v3", {**COMMON, "target_modules": MLA, "target_parameters": DEEPSEEK_MLPS + EXPERTS}),
    # DeepSeek-V3 as a PEFT user writes it: the MLP names as target_modules, which peft 0.21 rewrites to
    # the fused routed experts (target_parameters gate_up_proj at rank 2r / alpha 2 alpha by rank_pattern /
    # alpha_pattern, down_proj at r); the dense MLPs and shared experts then take none
    "deepseek_v3_rewritten": ("deepseek_v3", {**COMMON, "target_modules": MLA + ["gate_proj", "up_proj", "down_proj"]}),
    # and all-linear, which peft rewrites to the five, the routed experts (as above) and the router (gate.weight)
    "deepseek_v3_all_linear": ("deepseek_v3", {**COMMON, "target_modules": "all-linear"}),
    "llama3_rslora": (
        "llama3",
        dict(
            r=8,
            lora_alpha=16,
            lora_dropout=0.0,
            target_modules=["q_proj", "v_proj"],
            init_lora_weights=False,
            use_rslora=True,
        ),
    ),
}


def load_base(base: str):
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(HF / base, dtype=torch.float32, attn_implementation="eager").eval()


def logits_of(model, tokens: np.ndarray) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(torch.from_numpy(tokens.astype(np.int64))).logits.float().numpy().astype(np.float32)


def generate(only: list[str] | None = None) -> None:
    import torch
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open
    from safetensors.numpy import load_file, save_file

    OUT.mkdir(parents=True, exist_ok=True)
    for name, (base, kw) in ADAPTERS.items():
        if only and name not in only:
            continue
        golden = load_file(str(HF / f"{base}_logits.safetensors"))
        tokens = golden["tokens"]
        model = load_base(base)
        base_logits = logits_of(model, tokens)
        base_err = float(np.abs(base_logits - golden["logits"]).max())
        assert base_err < 1e-5, f"{base}: base logits differ from its golden by {base_err}"
        torch.manual_seed(sum(map(ord, "lora:" + name)))
        model = get_peft_model(model, LoraConfig(task_type="CAUSAL_LM", **kw)).eval()
        logits = logits_of(model, tokens)
        d = OUT / name
        d.mkdir(exist_ok=True)
        for f in d.glob("*"):
            f.unlink()
        model.save_pretrained(d)
        (d / "README.md").unlink(missing_ok=True)  # peft's model-card template
        cfg_path = d / "adapter_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["base_model_name_or_path"] = f"tests/golden/hf/{base}"
        cfg["target_modules"] = sorted(cfg["target_modules"])  # a set in peft: stable file
        cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        merged = model.merge_and_unload()
        merged_logits = logits_of(merged, tokens)
        merge_err = float(np.abs(merged_logits - logits).max())
        assert merge_err < 1e-4, f"{name}: merged logits differ by {merge_err}"
        save_file(
            {"tokens": tokens, "logits": logits, "merged_logits": merged_logits},
            str(OUT / f"{name}_logits.safetensors"),
        )
        assert check_peft(base, str(d), name, quiet=True) == 0
        with safe_open(str(d / "adapter_model.safetensors"), "np") as f:
            keys = list(f.keys())
            first = [(k, tuple(f.get_slice(k).get_shape())) for k in keys if ".layers.0." in k]
        print(
            f"{name} (base {base}): {sorted(p.name for p in d.iterdir())}, "
            f"{(d / 'adapter_model.safetensors').stat().st_size} B, {len(keys)} tensors; "
            f"|base - hf golden| {base_err:.3g}, max |adapted - base| {np.abs(logits - base_logits).max():.3g}, |merged - adapted| {merge_err:.3g}; "
            f"PeftModel.from_pretrained reload OK\n  layer 0: {first}"
        )


def check_peft(base: str, adapter_dir: str, logits: str, quiet: bool = False) -> int:
    from peft import PeftModel
    from safetensors.numpy import load_file

    src = Path(logits) if logits.endswith(".safetensors") else OUT / f"{logits}_logits.safetensors"
    want = load_file(str(src))
    model = PeftModel.from_pretrained(load_base(base), adapter_dir).eval()
    err = float(np.abs(logits_of(model, want["tokens"]) - want["logits"]).max())
    if not quiet or err >= 1e-4:
        print(
            f"{adapter_dir} on tests/golden/hf/{base}: PeftModel.from_pretrained OK "
            f"({type(model).__name__}, {model.peft_config['default'].peft_type}); "
            f"max |logits - {src.name}| = {err:.3g}"
        )
    return 0 if err < 1e-4 else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check-peft", nargs=3, metavar=("BASE_NAME", "ADAPTER_DIR", "LOGITS"))
    ap.add_argument("--only", nargs="+", metavar="NAME", help="regenerate these adapters only")
    args = ap.parse_args()
    sys.exit(check_peft(*args.check_peft) if args.check_peft else generate(args.only))
