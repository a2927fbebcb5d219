"""Router losses and metrics of a mixture-of-experts model in the trainer.

In the loss (`router_terms`): the load-balancing aux loss times `router_aux_loss_coef`, the
router z-loss times `router_z_loss_coef` and DeepSeek-V3's sequence-wise balance loss (the
sparse layers' sum of `moe.seq_balance`) times `seq_aux_loss_coef` (the report's alpha) are
added to the cross-entropy, as transformers adds `router_aux_loss_coef * aux_loss` to `.loss`. Out of the step, as its
aux (`router_aux`): aux loss, z-loss, each expert's share of the routed (token, expert)
pairs (E,), and the pairs dropped over capacity. Per logged window (`summarise`), into
metrics.jsonl: `router_aux_loss`, `router_z_loss`, `expert_load_min` / `expert_load_max`
(shares; 1 / E each when balanced), `expert_load_imbalance` (max share x E: 1 when
balanced), `dropped_tokens` (per step, mean over the window), `router_seq_aux_loss` (the sequence-wise
term before alpha: the number of sparse layers when balanced); with multi-token prediction
`mtp_loss` (`fsdp_jax.app.objectives.mtp`), the window's mean. The aux also carries each
layer's counts (`expert_counts`, (L, E)) for DeepSeek-V3's bias rule (`expert_bias`).
"""

from __future__ import annotations

import numpy as np

from fsdp_jax.app.models.moe import RouterStats, aux_loss, expert_load, z_loss


def router_terms(cfg, stats: RouterStats):
    """(the router terms added to the mean loss, the step's aux dict) for model config `cfg`."""
    aux, z = aux_loss(stats), z_loss(stats)
    extra = cfg.router_aux_loss_coef * aux + cfg.router_z_loss_coef * z
    if cfg.seq_aux_loss_coef:  # DeepSeek-V3's sequence-wise balance loss, summed over the sparse layers
        extra = extra + cfg.seq_aux_loss_coef * stats.seq_balance
    return extra, router_aux(stats, aux, z)


def router_aux(stats: RouterStats, aux=None, z=None) -> dict:
    out = {
        "router_aux_loss": aux_loss(stats) if aux is None else aux,
        "router_z_loss": z_loss(stats) if z is None else z,
        "expert_load": expert_load(stats),
        "dropped_tokens": stats.dropped,
        "router_seq_aux_loss": stats.seq_balance,
    }
    if stats.layer_counts is not None:  # (L, E): the aux-loss-free bias rule's loads (`expert_bias`)
        out["expert_counts"] = stats.layer_counts
    return out


def summarise(auxes: list[dict]) -> dict:
    """The window's record fields from the steps' aux dicts (leaves may carry a leading
    microbatch dim)."""
    if not auxes:
        return {}

    def mean(key, vec=False):
        vals = [np.asarray(a[key], np.float64) for a in auxes]
        vals = [v.reshape(-1, v.shape[-1]).mean(0) if vec else v.mean() for v in vals]
        return np.mean(vals, axis=0)

    out = {"mtp_loss": float(mean("mtp_loss"))} if "mtp_loss" in auxes[0] else {}  # a dense model's MTP
    if "expert_load" not in auxes[0]:
        return out
    load = mean("expert_load", vec=True)
    return {
        **out,
        "router_aux_loss": float(mean("router_aux_loss")),
        "router_z_loss": float(mean("router_z_loss")),
        "expert_load_min": float(load.min()),
        "expert_load_max": float(load.max()),
        "expert_load_imbalance": float(load.max() * load.size),
        "dropped_tokens": float(np.mean([np.asarray(a["dropped_tokens"]).sum() for a in auxes])),
        "router_seq_aux_loss": float(mean("router_seq_aux_loss")),
    }
