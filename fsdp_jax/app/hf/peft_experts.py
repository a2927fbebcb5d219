"""PEFT's LoRA adapters on mixture-of-experts tensors, in and out, and merged.

transformers (5.x) holds a sparse layer's experts as two fused 3-D parameters,
`mlp.experts.gate_up_proj` (E, 2F, D) and `mlp.experts.down_proj` (E, D, F), which PEFT adapts
through `target_parameters` (its `ParamWrapper`). An adapted tensor's two factors are
`lora_A.weight` (r * E, in), rows expert-major, and `lora_B.weight` (out, r * E), columns
rank-major, with delta_e = B.reshape(out, r, E)[..., e] @ A.reshape(E, r, in)[e] * scale
(peft 0.21.2, `tuners/lora/layer.py`, `ParamWrapper.get_delta_weight`). Two targeted tensors
of one module nest: the first transformers registers (gate_up_proj) is wrapped first, so its
factors sit under `experts.base_layer.` and down_proj's under `experts.`; one alone under
`experts.` (`tests/golden/make_peft_goldens.py` lists a tiny Mixtral's keys).

peft 0.21 on DeepSeek-V3 (and Qwen3-MoE) rewrites target_modules gate_proj / up_proj / down_proj
onto these tensors: gate_up_proj then takes rank 2r and alpha 2 alpha through adapter_config.json's
`rank_pattern` / `alpha_pattern` (key `.*\\.gate_up_proj`), down_proj r: `LoraSpec.gate_up_rank`
(`pattern_rank` reads it, `patterns` writes it).

The decoder's expert adapters (`fsdp_jax.app.models.lora.ExpertAdapter`) are `lora_a`
(E, in, r) and `lora_b` (E, r, out) per sparse layer: `experts_gate_up` (out 2F: gate's F columns,
then up's, as transformers chunks gate_up_proj) and `experts_down`.
"""

from __future__ import annotations

import numpy as np

from fsdp_jax.app.models import lora

# the decoder's expert adapter -> the transformers parameter PEFT targets
PEFT_PARAMETERS = {"experts_gate_up": "mlp.experts.gate_up_proj", "experts_down": "mlp.experts.down_proj"}


GATE_UP_PATTERN = r".*\.gate_up_proj"  # the rank_pattern / alpha_pattern key peft 0.21 writes


def pattern_rank(raw: dict) -> int:
    """The experts' gate_up_proj rank an adapter_config's rank_pattern gives (0: none, all at r);
    ValueError for a pattern on anything else, or an alpha_pattern that does not scale alpha with it."""
    ranks, alphas = raw.get("rank_pattern") or {}, raw.get("alpha_pattern") or {}
    other = [k for k in {**ranks, **alphas} if not k.endswith("gate_up_proj")]
    if other or len(set(ranks.values())) > 1:
        what = other[0] if other else "gate_up_proj (several ranks)"
        raise ValueError(f"rank_pattern / alpha_pattern on {what}: only the experts' gate_up_proj takes its own rank")
    rank = next(iter(ranks.values()), 0)
    want = float(raw.get("lora_alpha", 0)) * rank / float(raw.get("r") or 1)
    if any(float(a) != want for a in alphas.values()) or (rank and rank != raw.get("r") and not alphas):
        raise ValueError(f"alpha_pattern: gate_up_proj at rank {rank} needs alpha {want:g} (lora_alpha x its rank / r)")
    return 0 if rank == raw.get("r") else int(rank)


def patterns(spec: lora.LoraSpec, parts: tuple[str, ...]) -> dict:
    """adapter_config.json's rank_pattern and alpha_pattern for `spec` with expert adapters `parts`."""
    g = spec.expert("experts_gate_up")
    if "experts_gate_up" not in parts or g.rank == spec.rank:
        return {}
    return {"rank_pattern": {GATE_UP_PATTERN: g.rank}, "alpha_pattern": {GATE_UP_PATTERN: g.alpha}}


def parts_of(parameters) -> tuple[str, ...]:
    """The expert adapters a PEFT config's `target_parameters` adapt, in `EXPERT_ADAPTERS`
    order (ValueError naming an unknown one)."""
    out = []
    for p in parameters or []:
        name = next((ours for ours, theirs in PEFT_PARAMETERS.items() if p == theirs or theirs.endswith("." + p)), None)
        if name is None:
            raise ValueError(f"target_parameters {p!r}: only {' '.join(PEFT_PARAMETERS.values())} are known")
        out.append(name)
    return tuple(n for n in lora.EXPERT_ADAPTERS if n in out)


def peft_key(layer: int, part: str, half: str, parts: tuple[str, ...]) -> str:
    """PEFT's name of expert adapter `part`'s lora_A / lora_B in `layer`, `parts` all the
    expert adapters present (the nesting depends on them)."""
    nest = "base_layer." * (len(parts) - 1 - parts.index(part))
    return f"base_model.model.model.layers.{layer}.mlp.experts.{nest}lora_{half}.weight"


def to_peft(a: np.ndarray, b: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """One layer's (lora_a (E, in, r), lora_b (E, r, out)) -> PEFT's (A (r * E, in), B (out, r * E))."""
    e, d_in, r = a.shape
    big_a = a.transpose(0, 2, 1).reshape(e * r, d_in)
    big_b = b.transpose(2, 1, 0).reshape(b.shape[2], r * e)
    return np.ascontiguousarray(big_a), np.ascontiguousarray(big_b)


def from_peft(big_a: np.ndarray, big_b: np.ndarray, n_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """`to_peft`'s inverse."""
    r = big_a.shape[0] // n_experts
    a = big_a.reshape(n_experts, r, -1).transpose(0, 2, 1)
    b = big_b.reshape(big_b.shape[0], r, n_experts).transpose(2, 1, 0)
    return np.ascontiguousarray(a), np.ascontiguousarray(b)


def shapes(cfg, part: str, rank: int) -> dict[str, tuple[int, int]]:
    """PEFT's A and B shapes of expert adapter `part` on model `cfg`."""
    d_in, _, d_out, _ = lora.expert_adapter_dims(cfg, part)
    return {"A": (rank * cfg.n_experts, d_in), "B": (d_out, rank * cfg.n_experts)}


def merged_weight(name: str, w: np.ndarray, a: np.ndarray, b: np.ndarray, spec: lora.LoraSpec) -> np.ndarray:
    """One layer's expert weight `name` (w_gate, w_up (E, D, F), w_down (E, F, D), or gpt-oss's
    w_gate_up (E, D, 2F), gate / up interleaved, taking the whole B) plus its
    share of its adapter's scale * A B (`a` (E, in, r), `b` (E, r, out): experts_gate_up's B columns
    gate's F then up's), computed in f32, in W's dtype."""
    f = w.shape[-1]
    b = {"w_gate": b[..., :f], "w_up": b[..., f:]}.get(name, b)  # w_down, gpt-oss's fused w_gate_up: all
    delta = np.einsum("eir,ero->eio", a.astype(np.float32), b.astype(np.float32)) * np.float32(spec.scale)
    return (w.astype(np.float32) + delta).astype(w.dtype)


def part_of(name: str) -> str:
    """The expert adapter that adapts expert weight `name` (gpt-oss's fused w_gate_up: experts_gate_up)."""
    return "experts_gate_up" if name == "w_gate_up" else next(p for p, ws in lora.EXPERT_ADAPTERS.items() if name in ws)
