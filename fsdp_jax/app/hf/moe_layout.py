"""Tensor layout of the mixture-of-experts families: our param paths <-> HF tensor names.

Layers of an MoE model live in segments (`fsdp_jax.app.models.stack`): `segments/<j>/
layers/<m>/...` stacked over groups, or `segments/<i>/...` unscanned. A sparse layer's MLP
is our `moe/...`:
  moe/router (D, E)           <- <mlp>.gate.weight (E, D), transposed
  moe/w_gate (E, D, F)        <- <mlp>.experts.<e>.<gate>.weight (F, D) each, transposed
  moe/w_up   (E, D, F)        <- <mlp>.experts.<e>.<up>.weight
  moe/w_down (E, F, D)        <- <mlp>.experts.<e>.<down>.weight (D, F)
with <mlp> and the expert names of the family (`families.expert_names`: transformers'
generic `mlp` + gate_proj / up_proj / down_proj unless a family has its own), plus what a
family's switches add to a sparse layer (`families.moe_weight_names`: a shared expert).
The published per-expert layout is read and written (transformers 5.24 saves it
from its fused in-memory experts). An expert leaf's kind is "e:t": the HF name holds `{e}`,
one tensor per expert stacked on our leading expert dim.
"""

from __future__ import annotations

from fsdp_jax.app.models import families
from fsdp_jax.app.models.stack import segment_layers

EXPERT_KIND = "e:"


def moe_tensors(cfg) -> dict[str, tuple[str, str]]:
    """{our path under a sparse block: (HF name under model.layers.N, kind)}; what a family's
    sparse MLP part names (`Family.part_weights`, `moe/...`) is added, and replaces the generic
    router and experts when it names `moe/router`."""
    own = {k: (n, kind) for k, (n, kind, _) in families.part_tensors(cfg).items() if k.startswith("moe/")}
    if "moe/router" in own:
        return {**own, **families.moe_weight_names(cfg)}
    pre, names = families.expert_names(cfg)
    out = {"moe/router": (f"{pre}.gate.weight", "t")}
    for ours, theirs in zip(("w_gate", "w_up", "w_down"), names):
        out[f"moe/{ours}"] = (f"{pre}.experts.{{e}}.{theirs}.weight", EXPERT_KIND + "t")
    out.update(families.moe_weight_names(cfg))
    return {**out, **own}


def moe_shapes(cfg) -> dict[str, tuple[int, ...]]:
    """{our path under a sparse block: the shape of ONE HF tensor (one expert's)}."""
    d, e, f, fs = cfg.d_model, cfg.n_experts, cfg.moe_ffn_dim, cfg.shared_expert_ffn_dim
    return {
        "moe/router": (e, d),
        "moe/w_gate": (f, d),
        "moe/w_up": (f, d),
        "moe/w_down": (d, f),
        "moe/shared_gate": (fs, d),
        "moe/shared_up": (fs, d),
        "moe/shared_down": (d, fs),
        "moe/shared_weight": (1, d),
    }


def per_layer(cfg, dense: dict[str, tuple[str, str]], sparse: bool) -> dict[str, tuple[str, str]]:
    """One layer's {our path: (HF name, kind)}: `dense` (the dense layer's table), its MLP
    replaced by the experts when `sparse`."""
    if not sparse:
        return dict(dense)
    out = {k: v for k, v in dense.items() if not k.startswith("mlp/")}
    out.update(moe_tensors(cfg))
    return out


def expected(cfg, dense: dict[str, tuple[str, str]], dense_shapes: dict[str, tuple[int, ...]]) -> dict:
    """{HF tensor name: shape} of the layers of an MoE checkpoint (experts one by one)."""
    shapes = {**moe_shapes(cfg), **dense_shapes}  # a part's own (in dense_shapes) first
    out: dict[str, tuple[int, ...]] = {}
    for _, layers, sparse in segment_layers(cfg):
        for i in layers:
            for ours, (name, kind) in per_layer(cfg, dense, sparse).items():
                names = [name.format(e=e) for e in range(cfg.n_experts)] if kind.startswith(EXPERT_KIND) else [name]
                for n in names:
                    out[f"model.layers.{i}.{n}"] = shapes[ours]
    return dict(sorted(out.items(), key=lambda kv: _layer_of(kv[0])))


def _layer_of(name: str) -> int:
    return int(name.split(".")[2])


def leaf_sources(cfg, dense: dict[str, tuple[str, str]]) -> dict[str, tuple[list[str], str]]:
    """{our layer param path: ([HF names, one per stacked entry], kind)}; an expert leaf's
    names hold `{e}`."""
    out: dict[str, tuple[list[str], str]] = {}
    for prefix, layers, sparse in segment_layers(cfg):
        for ours, (name, kind) in per_layer(cfg, dense, sparse).items():
            out[f"{prefix}/{ours}"] = ([f"model.layers.{i}.{name}" for i in layers], kind)
    return out


def is_stacked(cfg, path: str) -> bool:
    """Whether our leaf at `path` has a leading stacked-layers dim."""
    return cfg.scan_layers and path.startswith(("blocks/", "segments/"))
