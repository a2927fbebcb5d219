#!/usr/bin/env python
"""Regenerate the mixture-of-experts goldens of tests/golden/hf/: tiny random Mixtral,
Qwen3-MoE and Qwen2-MoE checkpoints written by transformers itself, the logits it
computes (eager attention, eager experts loop, float32) for fixed tokens, and its
router logits and load-balancing aux losses.

Needs torch + transformers, which the project never installs; use a separate venv
outside the repository, as for make_hf_family_goldens.py (these were made with Python
3.11, torch 2.13.0 CPU, transformers 5.24.0, safetensors 0.8.0, numpy 2.4):

    python3.11 -m venv VENV && VENV/bin/pip install torch==2.13.0 transformers==5.24.0 safetensors numpy
    VENV/bin/python tests/golden/make_hf_moe_goldens.py          # writes them
    VENV/bin/python tests/golden/make_hf_moe_goldens.py --check OUT LOGITS

`--check` loads OUT (e.g. written by `scripts/export.py RUN --hf OUT`) with
`AutoModelForCausalLM.from_pretrained` and prints the max abs difference of its
logits from LOGITS: a golden name, or a .safetensors file holding `tokens` and the
project's `logits` for them (exit 1 above 1e-4). When LOGITS also holds `aux_loss`
(the goldens do), the reloaded model's aux loss is compared too.

Style as make_hf_family_goldens.py: vocab 256, hidden 64, float32 weights N(0, 0.15),
norm weights (every *norm.weight, q_norm/k_norm included) 1 + N(0, 0.1), tokens 2 x 40
from RandomState(24). Router weights (`mlp.gate.weight`) N(0, 0.25): router logits
then have std ~2. Routing must be decisive, so that float-rounding differences cannot
flip a top-k choice: the torch seed is sum(map(ord, name)) + attempt, attempt = 0, 1, ...
the first for which, over all tokens of every sparse layer in both the unmasked and the
masked run, the gap between the k-th and (k+1)-th softmax router probability is > 1e-4
AND the same gap in router logits is > 1e-2. (N(0, 0.5) gives bigger logit gaps but
softmax so peaked that the k-th and (k+1)-th probabilities are both ~1e-3 and their
gap under 1e-4 for all of the 10 seeds tried for Mixtral.) As generated with transformers 5.24:
  mixtral    attempt 5, min gap prob 6.17e-4, logit 0.0210
  qwen3_moe  attempt 1, min gap prob 1.45e-3, logit 0.0134
  qwen2_moe  attempt 1, min gap prob 4.79e-3, logit 0.0249

  mixtral    MixtralConfig: 2 layers, both sparse; 4 experts, top-2 (weights always
             renormalised over the top 2), intermediate 96, GQA 4/2 heads (head_dim
             null in config.json, as published Mixtral configs: hidden / heads = 16),
             sliding_window null, untied, rope_theta 1e6, router_aux_loss_coef 0.02
  qwen3_moe  Qwen3MoeConfig: 3 layers, decoder_sparse_step 1, mlp_only_layers [1] ->
             layers 0 and 2 sparse, layer 1 a dense MLP (intermediate_size 128);
             8 experts, top-2, moe_intermediate_size 48, norm_topk_prob True, GQA 4/2
             heads, head_dim 32 (!= hidden / heads), q/k RMSNorm, TIED embeddings
             (no lm_head.weight in the file), rope_theta 1e6, router_aux_loss_coef 0.01
  qwen2_moe  Qwen2MoeConfig: 3 layers, decoder_sparse_step 2 -> layer 1 sparse
             ((1 + 1) % 2 == 0), layers 0 and 2 dense MLPs (intermediate_size 128);
             6 experts, top-2, moe_intermediate_size 48, norm_topk_prob False (top-2
             softmax probs used as they are), shared expert (intermediate 96) scaled by
             sigmoid(shared_expert_gate(x)), q/k/v biases, GQA 4/2, untied,
             rope_theta 1e6, router_aux_loss_coef 0.01
  transformers' rule (Qwen2Moe/Qwen3MoeDecoderLayer): layer i is sparse iff
  i not in mlp_only_layers and num_experts > 0 and (i + 1) % decoder_sparse_step == 0.

Checkpoint layout. transformers 5.24 holds experts FUSED in memory: `mlp.experts.
gate_up_proj` (E, 2*I, H) = concat([gate_e; up_e], dim 1), `mlp.experts.down_proj`
(E, H, I), and Mixtral's router under `mlp.gate` (not `block_sparse_moe.gate`). Its
save_pretrained converts back (reverse of conversion_mapping.py's WeightConverters) and
writes the PUBLISHED per-expert layout; the script asserts that every saved expert tensor
equals the matching slice of the fused one, and would re-write the file per-expert
itself if a transformers version ever saved the fused keys. Keys of one layer as saved
(all float32, nn.Linear (out, in) orientation):
  mixtral layer 1:
    model.layers.1.block_sparse_moe.gate.weight            (4, 64)
    model.layers.1.block_sparse_moe.experts.{0..3}.w1.weight  (96, 64)   gate
    model.layers.1.block_sparse_moe.experts.{0..3}.w3.weight  (96, 64)   up
    model.layers.1.block_sparse_moe.experts.{0..3}.w2.weight  (64, 96)   down
    model.layers.1.self_attn.{q,o}_proj.weight (64, 64), {k,v}_proj.weight (32, 64)
    model.layers.1.{input,post_attention}_layernorm.weight (64,)
  qwen3_moe layer 0 (sparse; layer 2 alike):
    model.layers.0.mlp.gate.weight                          (8, 64)
    model.layers.0.mlp.experts.{0..7}.gate_proj.weight      (48, 64)
    model.layers.0.mlp.experts.{0..7}.up_proj.weight        (48, 64)
    model.layers.0.mlp.experts.{0..7}.down_proj.weight      (64, 48)
    model.layers.0.self_attn.q_proj.weight (128, 64), {k,v}_proj.weight (64, 64),
    o_proj.weight (64, 128), {q,k}_norm.weight (32,)
  qwen3_moe layer 1 (dense): model.layers.1.mlp.{gate,up}_proj.weight (128, 64),
    model.layers.1.mlp.down_proj.weight (64, 128)
  qwen2_moe layer 1 (sparse):
    model.layers.1.mlp.gate.weight                          (6, 64)
    model.layers.1.mlp.experts.{0..5}.{gate,up}_proj.weight (48, 64)
    model.layers.1.mlp.experts.{0..5}.down_proj.weight      (64, 48)
    model.layers.1.mlp.shared_expert.{gate,up}_proj.weight  (96, 64)
    model.layers.1.mlp.shared_expert.down_proj.weight       (64, 96)
    model.layers.1.mlp.shared_expert_gate.weight            (1, 64)
    model.layers.1.self_attn.{q,o}_proj.weight (64, 64), {k,v}_proj.weight (32, 64),
    q_proj.bias (64,), {k,v}_proj.bias (32,)
  qwen2_moe layers 0, 2 (dense): mlp.{gate,up}_proj.weight (128, 64), down (64, 128)
Generation reloads each committed directory with from_pretrained and asserts its logits
are bit-identical to the stored ones.

Logits file `<name>_logits.safetensors`:
  tokens (2, 40) int32; logits (2, 40, 256) float32 (no mask)
  router_logits_<i> (80, E) float32 for each SPARSE decoder layer i (rows = batch-major
    flattened tokens, b * 40 + t; raw gate outputs before softmax; dense layers have
    none: transformers records the outputs of its TopKRouter modules only)
  aux_loss () float32: model(tokens, output_router_logits=True).aux_loss
  attention_mask (2, 40) int32: ones, but row 1's last 10 tokens 0
  aux_loss_masked () float32, logits_masked (2, 40, 256): the same call with that mask
  lm_loss (): model(tokens, labels=tokens).loss (shifted next-token CE, mean over 78)
  loss (): model(tokens, labels=tokens, output_router_logits=True).loss
    = lm_loss + router_aux_loss_coef * aux_loss

Aux loss, as transformers 5.24 computes it (load_balancing_loss_func, the same code in
modeling_mixtral.py, modeling_qwen2_moe.py and modeling_qwen3_moe.py), over the tuple of
router logits of all sparse layers, with E experts, k = num_experts_per_tok:
  p = softmax(router_logits, -1) per layer, in float32; sel = top-k indices of p
  rows pooled over ALL sparse layers (L layers x N tokens, not a per-layer mean):
  tokens_per_expert[e] = sum_{layers, tokens} m_t * #{j < k : sel_tj == e} / sum m_t
  router_prob[e]       = sum_{layers, tokens} m_t * p_te / sum m_t
  aux_loss = E * sum_e tokens_per_expert[e] * router_prob[e]
where m_t is the attention mask (all ones without one) and sum m_t counts over layers
too (L * tokens). So sum_e tokens_per_expert = k, and a perfectly balanced router gives
aux_loss = k (not 1). Top-k is taken on the full softmax (norm_topk_prob does not enter),
and the coefficient is NOT in `.aux_loss`: it is added only to `.loss`, and only when
labels are given (loss += router_aux_loss_coef * aux_loss). Generation asserts that an
independent numpy version of this formula (numpy_aux_loss) matches `.aux_loss` to 1e-5,
masked and not, and that loss - lm_loss == router_aux_loss_coef * aux_loss. Stored:
  mixtral    aux_loss 2.033419, aux_loss_masked 2.038373, lm_loss 6.359777, loss 6.400445
  qwen3_moe  aux_loss 2.478813, aux_loss_masked 2.369828, lm_loss 6.227636, loss 6.252424
  qwen2_moe  aux_loss 2.711446, aux_loss_masked 2.700736, lm_loss 6.128797, loss 6.155911
The default experts implementation (grouped_mm where it can dispatch) gives logits within
1.5e-6 of the eager loop used here.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import numpy as np

OUT = Path(__file__).resolve().parent / "hf"
TOKENS = np.random.RandomState(24).randint(0, 256, size=(2, 40)).astype(np.int64)
MASK = np.ones((2, 40), dtype=np.int64)
MASK[1, -10:] = 0
MIN_MARGIN = 1e-4  # softmax probability, k-th minus (k+1)-th
MIN_LOGIT_GAP = 1e-2  # the same gap in router logits
ROUTER_STD = 0.25
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    max_position_embeddings=128,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    rope_parameters={"rope_type": "default", "rope_theta": 1e6},
)
MODELS = {
    "mixtral": (
        "MixtralConfig",
        dict(
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            sliding_window=None,
            tie_word_embeddings=False,
            router_aux_loss_coef=0.02,
        ),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            num_experts=8,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
            tie_word_embeddings=True,
            use_sliding_window=False,
            router_aux_loss_coef=0.01,
        ),
    ),
    "qwen2_moe": (
        "Qwen2MoeConfig",
        dict(
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_experts=6,
            num_experts_per_tok=2,
            moe_intermediate_size=48,
            shared_expert_intermediate_size=96,
            norm_topk_prob=False,
            decoder_sparse_step=2,
            mlp_only_layers=[],
            qkv_bias=True,
            tie_word_embeddings=False,
            use_sliding_window=False,
            router_aux_loss_coef=0.01,
        ),
    ),
}
# Published per-expert names: (fused in-memory prefix, per-expert name of gate, up, down).
PUBLISHED = {
    "mixtral": ("block_sparse_moe", ("w1", "w3", "w2")),
    "qwen3_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
    "qwen2_moe": ("mlp", ("gate_proj", "up_proj", "down_proj")),
}


def sparse_layers(cfg) -> list[int]:
    if cfg.model_type == "mixtral":
        return list(range(cfg.num_hidden_layers))
    return [
        i
        for i in range(cfg.num_hidden_layers)
        if i not in (cfg.mlp_only_layers or []) and cfg.num_experts > 0 and (i + 1) % cfg.decoder_sparse_step == 0
    ]


def top_k(cfg) -> int:
    return cfg.num_experts_per_tok


def run(model, mask=None, labels=None, router=True):
    import torch

    with torch.no_grad():
        out = model(
            torch.from_numpy(TOKENS),
            attention_mask=None if mask is None else torch.from_numpy(mask),
            labels=None if labels is None else torch.from_numpy(labels),
            output_router_logits=router,
        )
    return out


def margins(router_logits, k: int) -> tuple[float, float]:
    """Smallest gap between the k-th and (k+1)-th router probability, and logit, over
    all tokens of all layers."""
    import torch

    prob = logit = float("inf")
    for rl in router_logits:
        p = torch.softmax(rl.float(), dim=-1).sort(dim=-1, descending=True).values
        lg = rl.float().sort(dim=-1, descending=True).values
        prob = min(prob, float((p[:, k - 1] - p[:, k]).min()))
        logit = min(logit, float((lg[:, k - 1] - lg[:, k]).min()))
    return prob, logit


def numpy_aux_loss(router_logits: list[np.ndarray], k: int, mask: np.ndarray | None) -> float:
    """The docstring's formula, independently of transformers (asserted equal to it)."""
    n_exp = router_logits[0].shape[-1]
    counts = np.zeros(n_exp)
    probs = np.zeros(n_exp)
    rows = 0.0
    for rl in router_logits:
        z = rl.astype(np.float64)
        p = np.exp(z - z.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        m = np.ones(len(p)) if mask is None else mask.reshape(-1).astype(np.float64)
        sel = np.argsort(-p, axis=-1, kind="stable")[:, :k]
        for j in range(k):
            counts += np.bincount(sel[:, j], weights=m, minlength=n_exp)
        probs += (p * m[:, None]).sum(0)
        rows += m.sum()
    return float(n_exp * np.sum(counts / rows * probs / rows))


def make_model(name: str, attempt: int = 0):
    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    cls, kw = MODELS[name]
    cfg = getattr(transformers, cls)(**{**COMMON, **kw})
    torch.manual_seed(sum(map(ord, name)) + attempt)
    model = AutoModelForCausalLM.from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32
    ).eval()
    with torch.no_grad():
        for pname, p in model.named_parameters():
            if pname.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            elif pname.endswith("mlp.gate.weight"):
                p.normal_(0, ROUTER_STD)
            else:
                p.normal_(0, 0.15)
    return model


def goldens(model) -> tuple[dict, tuple[float, float]] | None:
    """The stored arrays and the routing margins; None where routing is not decisive."""
    cfg = model.config
    k = top_k(cfg)
    layers = sparse_layers(cfg)
    plain = run(model)
    masked = run(model, mask=MASK)
    lm = run(model, labels=TOKENS, router=False)
    full = run(model, labels=TOKENS)
    assert len(plain.router_logits) == len(layers), (len(plain.router_logits), layers)
    margin = tuple(map(min, zip(margins(plain.router_logits, k), margins(masked.router_logits, k))))
    if margin[0] <= MIN_MARGIN or margin[1] <= MIN_LOGIT_GAP:
        return None
    for o, mask in ((plain, None), (masked, MASK)):
        rls = [rl.float().numpy() for rl in o.router_logits]
        assert abs(numpy_aux_loss(rls, k, mask) - float(o.aux_loss)) < 1e-5
    coef = cfg.router_aux_loss_coef
    assert abs(float(full.loss) - float(lm.loss) - coef * float(full.aux_loss)) < 1e-6
    f32 = lambda t: t.float().numpy().astype(np.float32)  # noqa: E731
    out = {
        "tokens": TOKENS.astype(np.int32),
        "logits": f32(plain.logits),
        "aux_loss": f32(plain.aux_loss),
        "attention_mask": MASK.astype(np.int32),
        "aux_loss_masked": f32(masked.aux_loss),
        "logits_masked": f32(masked.logits),
        "lm_loss": f32(lm.loss),
        "loss": f32(full.loss),
    }
    for i, rl in zip(layers, plain.router_logits):
        out[f"router_logits_{i}"] = f32(rl)
    return out, margin


def published_layout(name: str, model, path: Path) -> str:
    """Make path's safetensors hold the per-expert layout; check each tensor against the
    fused in-memory one. Returns what transformers itself wrote."""
    from safetensors.numpy import load_file, save_file

    prefix, (g, u, d) = PUBLISHED[name]
    state = load_file(str(path))
    fused = [key for key in state if re.search(r"experts\.(gate_up_proj|down_proj)$", key)]
    wrote = "fused" if fused else "per-expert"
    for key in fused:  # only if a transformers version saves the in-memory layout
        layer = key.split(".experts.")[0].replace(".mlp", f".{prefix}")
        w = state.pop(key)
        inter = w.shape[1] // 2
        for e in range(w.shape[0]):
            if key.endswith("gate_up_proj"):
                state[f"{layer}.experts.{e}.{g}.weight"] = np.ascontiguousarray(w[e, :inter])
                state[f"{layer}.experts.{e}.{u}.weight"] = np.ascontiguousarray(w[e, inter:])
            else:
                state[f"{layer}.experts.{e}.{d}.weight"] = np.ascontiguousarray(w[e])
    renamed = [key for key in state if prefix != "mlp" and ".mlp.gate." in key]
    for key in renamed:
        state[key.replace(".mlp.", f".{prefix}.")] = state.pop(key)
    if fused or renamed:
        save_file(state, str(path), metadata={"format": "pt"})
    params = dict(model.named_parameters())
    for i in sparse_layers(model.config):
        gu = params[f"model.layers.{i}.mlp.experts.gate_up_proj"].detach().numpy()
        dn = params[f"model.layers.{i}.mlp.experts.down_proj"].detach().numpy()
        inter = gu.shape[1] // 2
        base = f"model.layers.{i}.{prefix}"
        assert np.array_equal(
            state[f"{base}.gate.weight"], params[f"model.layers.{i}.mlp.gate.weight"].detach().numpy()
        )
        for e in range(gu.shape[0]):
            assert np.array_equal(state[f"{base}.experts.{e}.{g}.weight"], gu[e, :inter])
            assert np.array_equal(state[f"{base}.experts.{e}.{u}.weight"], gu[e, inter:])
            assert np.array_equal(state[f"{base}.experts.{e}.{d}.weight"], dn[e])
    assert not any("gate_up_proj" in key or "experts.down_proj" in key for key in state)
    return wrote


def generate() -> None:
    import torch
    from safetensors.numpy import save_file
    from transformers import AutoModelForCausalLM

    OUT.mkdir(parents=True, exist_ok=True)
    for name in MODELS:
        d = OUT / name
        d.mkdir(exist_ok=True)
        for f in d.glob("*"):
            f.unlink()
        for attempt in range(100):
            model = make_model(name, attempt)
            got = goldens(model)
            if got is not None:
                break
        out, margin = got
        model.save_pretrained(d)
        (d / "generation_config.json").unlink(missing_ok=True)
        wrote = published_layout(name, model, d / "model.safetensors")
        save_file(out, str(OUT / f"{name}_logits.safetensors"))
        back = AutoModelForCausalLM.from_pretrained(
            d, dtype=torch.float32, attn_implementation="eager", experts_implementation="eager"
        ).eval()
        again, _ = goldens(back)
        for key, want in out.items():
            assert np.array_equal(again[key], want), f"{name}: reloaded {key} differs"
        default = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32, attn_implementation="eager").eval()
        dflt = float(np.abs(run(default, router=False).logits.numpy() - out["logits"]).max())
        print(
            f"{d.name}: {sorted(p.name for p in d.iterdir())}, {(d / 'model.safetensors').stat().st_size} B; "
            f"transformers saved {wrote} experts; sparse layers {sparse_layers(model.config)}; "
            f"seed attempt {attempt}, min router margin prob {margin[0]:.3g} logit {margin[1]:.3g}; aux_loss {float(out['aux_loss']):.6f}, "
            f"masked {float(out['aux_loss_masked']):.6f}; lm_loss {float(out['lm_loss']):.6f}, "
            f"loss {float(out['loss']):.6f}; logits std {out['logits'].std():.3f}; reload bit-identical; "
            f"experts_implementation={default.config._experts_implementation} differs by {dflt:.3g}"
        )


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
