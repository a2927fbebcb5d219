"""Tensor layout of multi-token prediction modules (`model.mtp_depth`): our paths <-> HF names.

DeepSeek-V3's checkpoint keeps MTP depth k (1-based) as decoder layer num_hidden_layers + k - 1
(config.json `num_nextn_predict_layers`; transformers' DeepseekV3ForCausalLM leaves these layers
out when loading, vLLM's and SGLang's MTP drafters read them):
  model.layers.N.enorm.weight (D,), hnorm.weight (D,)      <- mtp/<k-1>/enorm, hnorm
  model.layers.N.eh_proj.weight (D, 2D)                    <- mtp/<k-1>/eh_proj (2D, D), transposed
  model.layers.N.shared_head.norm.weight (D,)              <- mtp/<k-1>/norm
  model.layers.N.<the decoder layer's tensors>             <- mtp/<k-1>/block/...
  model.layers.N.embed_tokens.weight, shared_head.head.weight: copies of the shared embedding
  and head (written from ours; read from the model's own, as every reader shares them).
Only a family that names the config key (`Family.mtp_key`) has the layout; other families
export without their MTP modules (a Hugging Face model of theirs has no place for them).
A checkpoint may hold more MTP layers than the run trains (`mtp_depth` fewer): the rest are
not read, as transformers reads none.
"""

from __future__ import annotations

from fsdp_jax.app.hf import moe_layout
from fsdp_jax.app.models import families

OWN = {  # our path under mtp/<k-1>: (HF name under model.layers.N, kind)
    "enorm/scale": ("enorm.weight", "id"),
    "hnorm/scale": ("hnorm.weight", "id"),
    "eh_proj": ("eh_proj.weight", "t"),
    "norm/scale": ("shared_head.norm.weight", "id"),
}
COPIES = {"embed_tokens.weight": ("embed", "id"), "shared_head.head.weight": ("head", "t")}


def config_key(cfg) -> str | None:
    """The config.json key of the family's MTP layer count, or None (no HF layout)."""
    fam = families.of_config(cfg)
    return fam.mtp_key if fam is not None else None


def held(raw: dict, cfg) -> int:
    """MTP layers a checkpoint's config.json says it holds (0 without the family's key)."""
    key = config_key(cfg)
    return int(raw.get(key) or 0) if key else 0


def _layers(cfg):
    return [(k, cfg.n_layers + k) for k in range(cfg.mtp_depth)] if config_key(cfg) else []


def leaf_sources(cfg, dense: dict[str, tuple[str, str]]) -> dict[str, tuple[list[str], str]]:
    """{our MTP param path: ([its HF name], kind)} (an expert leaf's name holds `{e}`)."""
    out = {}
    for k, i in _layers(cfg):
        table = {**OWN, **{f"block/{p}": v for p, v in moe_layout.per_layer(cfg, dense, cfg.is_sparse(i)).items()}}
        out.update({f"mtp/{k}/{ours}": ([f"model.layers.{i}.{name}"], kind) for ours, (name, kind) in table.items()})
    return out


def expected(cfg, dense: dict[str, tuple[str, str]], shapes: dict[str, tuple[int, ...]]) -> dict:
    """{HF tensor name: shape} of the MTP layers the run reads or writes (copies included)."""
    d, v = cfg.d_model, cfg.vocab_size
    own = {"enorm/scale": (d,), "hnorm/scale": (d,), "eh_proj": (d, 2 * d), "norm/scale": (d,)}
    shapes = {**moe_layout.moe_shapes(cfg), **shapes}
    out = {}
    for k, i in _layers(cfg):
        for ours, ([name], kind) in leaf_sources(cfg, dense).items():
            if not ours.startswith(f"mtp/{k}/"):
                continue
            local = ours[len(f"mtp/{k}/") :]
            shape = own[local] if local in own else shapes.get(local[len("block/") :], (d,))
            names = (
                [name.format(e=e) for e in range(cfg.n_experts)] if kind.startswith(moe_layout.EXPERT_KIND) else [name]
            )
            out.update({n: shape for n in names})
        out.update({f"model.layers.{i}.{n}": (v, d) for n in COPIES})
    return out


def copies(cfg) -> dict[str, tuple[str, str]]:
    """{HF name of a copy: (our shared leaf it is written from, kind)}."""
    table = {**COPIES, "shared_head.head.weight": ("embed", "id")} if cfg.tie_word_embeddings else COPIES
    return {f"model.layers.{i}.{n}": src for _, i in _layers(cfg) for n, src in table.items()}


def ignored(name: str, cfg, in_checkpoint: int) -> bool:
    """Is `name` a tensor of an MTP layer the checkpoint holds beyond the run's `mtp_depth`?"""
    parts = name.split(".")
    if len(parts) < 3 or parts[:2] != ["model", "layers"] or not parts[2].isdigit():
        return False
    return cfg.n_layers + cfg.mtp_depth <= int(parts[2]) < cfg.n_layers + in_checkpoint
