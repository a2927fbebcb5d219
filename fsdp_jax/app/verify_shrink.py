"""Shrinking a config for `verify` on a small machine, keeping every sharding decision:
each dim shrinks to a size with the same divisibility by the device count (so by every
mesh axis), `mesh.min_shard_size` is rescaled so the same params stay replicated, and
the per-param specs of the full and the reduced model are compared under every
strategy (`shrink_config`)."""

from __future__ import annotations

import dataclasses
import math

import optax

from fsdp_jax.app.models.lora import max_rank, resolve_experts, resolve_targets
from fsdp_jax.app.trainer.build import trainer_model
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.strategy import make_plan
from fsdp_jax.verify.compare import strategy_mesh_shape


def shrink_dim(size: int, target: int, n: int) -> int:
    """The smallest size >= `target` with the same gcd with `n` as `size` (so divisible
    by exactly the same mesh-axis sizes), never above `size`."""
    g = math.gcd(size, n)
    new = max(g, -(-target // g) * g)
    while new < size and math.gcd(new, n) != g:
        new += g
    return min(new, size)


def shrunk_model(m, n: int):
    """(reduced DecoderConfig, {key: (old, new)}) for `m` on `n` devices: 2 layers, about
    8 heads (the grouped-query ratio kept), d_model ~128, ffn ~2x d_model, vocab ~256; a
    mixture of experts: about 8 experts (at least top-k), expert ffn ~d_model;
    every dim a rule can map to a mesh axis keeps its gcd with `n`."""
    ratio = m.n_heads // m.n_kv_heads
    kv = shrink_dim(m.n_kv_heads, max(1, 8 // ratio), n)
    heads = kv * ratio  # keeps the grouped-query ratio
    if math.gcd(heads, n) != math.gcd(m.n_heads, n):
        heads = shrink_dim(m.n_heads, heads, n)
    # head_dim maps to no mesh axis; d_model = heads x head_dim (sharded over fsdp) must
    # keep its divisibility, so take the smallest even head_dim that gives it that
    head_dim = max(2, 128 // heads)
    head_dim += head_dim % 2
    while head_dim < m.head_dim and math.gcd(heads * head_dim, n) != math.gcd(m.d_model, n):
        head_dim += 2
    head_dim = min(head_dim, m.head_dim)
    d_model = heads * head_dim
    new = dataclasses.replace(
        m,
        n_layers=min(m.n_layers, 2),
        n_heads=heads,
        n_kv_heads=kv,
        d_model=d_model,
        ffn_dim=shrink_dim(m.ffn_dim, 2 * d_model, n),
        vocab_size=shrink_dim(m.vocab_size, 256, n),
        kv_channels=head_dim if m.kv_channels else 0,
    )
    if m.n_experts:  # experts keep their divisibility too (an expert rule may shard them), and top-k
        new = dataclasses.replace(
            new,
            n_experts=shrink_dim(m.n_experts, max(8, m.experts_per_token), n),
            moe_ffn_dim=shrink_dim(m.moe_ffn_dim, d_model, n),
            shared_expert_ffn_dim=shrink_dim(m.shared_expert_ffn_dim, 2 * d_model, n) if m.shared_expert_ffn_dim else 0,
            mlp_only_layers=tuple(i for i in m.mlp_only_layers if i < new.n_layers),
        )
    keys = ("n_layers", "d_model", "n_heads", "n_kv_heads", "ffn_dim", "vocab_size")
    keys += ("n_experts", "moe_ffn_dim", "shared_expert_ffn_dim") if m.n_experts else ()
    changed = {f"model.{k}": (getattr(m, k), getattr(new, k)) for k in keys if getattr(m, k) != getattr(new, k)}
    if m.head_dim != new.head_dim:
        changed["model.head_dim"] = (m.head_dim, new.head_dim)
    return new, changed


def shrunk_lora(section, model, changed: dict):
    """The `lora:` section for the reduced `model`: a rank no target of it allows (its
    smaller dim shrank below the rank) lowered to the most they allow, with alpha scaled so
    the adapters' scale (alpha / r, or alpha / sqrt(r) with rslora) stays; the rank dim maps
    to no mesh axis, so no sharding decision changes. Changes are added to `changed`."""

    if not section.rank:
        return section
    targets, experts = resolve_targets(section.targets), resolve_experts(section.target_parameters)
    rank = min(section.rank, max_rank(model, targets, experts))
    if rank == section.rank:
        return section
    ratio = rank / section.rank
    alpha = section.alpha * (math.sqrt(ratio) if section.rslora else ratio)
    changed["lora.rank"] = (section.rank, rank)
    changed["lora.alpha"] = (section.alpha, alpha)
    return dataclasses.replace(section, rank=rank, alpha=alpha)


def _rows(model_cfg, min_shard_size: int, strategy: str, devices, remat: str, rules=None, data: int = 1):
    """{param path: (shape, at-rest spec)} of the reference model under `strategy` and
    `rules` (the config's mesh.rules) on verify's mesh for it (`data` x fsdp)."""

    fns = trainer_model(model_cfg, remat)
    mesh = make_mesh(*strategy_mesh_shape(strategy, len(devices), data), devices=devices)
    plan = make_plan(
        fns.abstract_params,
        optax.sgd(0.1),
        mesh,
        strategy,
        fns.logical_axes,
        rules=rules,
        min_shard_size=min_shard_size,
        max_replicated_fraction=None,
    )
    return {r.path: (r.shape, r.spec) for r in plan.rows}


def shrink_config(cfg, n: int, strategies, devices, data: int = 1):
    """(reduced cfg, {key: (old, new)}, notes). Raises RuntimeError when the reduced
    model would shard any param differently from the full one under the config's mesh
    rules on verify's meshes (`data` x fsdp; so experts split over mesh axes keep that split:
    n_experts keeps its gcd with `n`, hence its divisibility by the expert axes)."""
    model, changed = shrunk_model(cfg.model, n)
    seq = shrink_dim(cfg.data.seq_len, 32, n)
    if seq != cfg.data.seq_len:
        changed["data.seq_len"] = (cfg.data.seq_len, seq)
    model = dataclasses.replace(model, max_seq_len=seq)
    # min_shard_size: the same params must stay replicated for being small
    rules = cfg.mesh.rules
    full = _rows(cfg.model, cfg.mesh.min_shard_size, strategies[0], devices, cfg.remat, rules, data)
    small_shapes = {p: s for p, (s, _) in _rows(model, 1, strategies[0], devices, cfg.remat, rules, data).items()}
    small = {p: math.prod(s) < cfg.mesh.min_shard_size for p, (s, _) in full.items()}
    below = [math.prod(small_shapes[p]) for p in full if small[p]]
    above = [math.prod(small_shapes[p]) for p in full if not small[p]]
    threshold = max(below, default=0) + 1
    if above and min(above) < threshold:
        raise RuntimeError(
            "cannot shrink this model keeping which params stay replicated; "
            "run with --max-params 0 to verify it at full size"
        )
    if threshold != cfg.mesh.min_shard_size:
        changed["mesh.min_shard_size"] = (cfg.mesh.min_shard_size, threshold)
    for s in strategies:
        a = _rows(cfg.model, cfg.mesh.min_shard_size, s, devices, cfg.remat, rules, data)
        b = _rows(model, threshold, s, devices, cfg.remat, rules, data)
        for path in a:
            if a[path][1] != b[path][1]:
                raise RuntimeError(
                    f"reduced model shards {path} as {b[path][1]} under {s}, the full "
                    f"model as {a[path][1]}; run with --max-params 0"
                )
    cfg = dataclasses.replace(
        cfg,
        model=model,
        data=dataclasses.replace(cfg.data, seq_len=seq),
        mesh=dataclasses.replace(cfg.mesh, min_shard_size=threshold),
        lora=shrunk_lora(cfg.lora, model, changed),
    )
    notes = [
        f"same sharding decision for every param under every strategy ({len(a)} params x "
        f"{len(strategies)} strategies compared, full vs reduced)"
    ]
    return cfg, changed, notes
