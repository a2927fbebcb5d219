"""The MoE fields of a decoder config the decoder cannot run: plain Python, no JAX, so the run
config's checks refuse them before JAX loads (`fsdp_jax.app.config.early_checks`).
`fsdp_jax.app.models.moe` re-exports `moe_config_problem`.
"""

from __future__ import annotations


def moe_config_problem(cfg) -> tuple[str, object, str] | None:
    """The first MoE field of `cfg` (a DecoderConfig) the decoder cannot run, as (field, value,
    what is allowed), or None."""
    e, k = cfg.n_experts, cfg.experts_per_token
    if not e:
        return None
    if not 1 <= k <= e:
        return "experts_per_token", k, f"must be in [1, n_experts={e}]"
    if cfg.moe_ffn_dim < 1:
        return "moe_ffn_dim", cfg.moe_ffn_dim, "must be > 0 with n_experts"
    if cfg.bias_update_speed and not cfg.n_group:
        return (
            "bias_update_speed",
            cfg.bias_update_speed,
            "needs a score-correction bias (DeepSeek-V3's grouped routing)",
        )
    if cfg.decoder_sparse_step < 1:
        return "decoder_sparse_step", cfg.decoder_sparse_step, "must be >= 1"
    bad = [i for i in cfg.mlp_only_layers if not 0 <= i < cfg.n_layers]
    if bad:
        return "mlp_only_layers", list(cfg.mlp_only_layers), f"layer indices are 0..{cfg.n_layers - 1}"
    return None
