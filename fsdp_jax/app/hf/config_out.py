"""`DecoderConfig` -> the Hugging Face config.json of its decoder family (what `fsdp_jax.app.hf.export` writes).

    config_json(cfg, "bfloat16", {"eos_token_id": 2}, hint=run_model_type)

The family is the one whose config.json maps back onto exactly `cfg`'s architecture
through `fsdp_jax.app.hf.config_in.model_config_from_hf` (the reading direction), `hint`
first, trying the registered families (`fsdp_jax.app.models.families`) in order; keys as transformers writes them, with both the 5.x
`rope_parameters` and the 4.x `rope_scaling` / top-level `rope_theta`.
"""

from __future__ import annotations

from fsdp_jax.app.hf.config_in import ARCH_FIELDS, ROPE_KEYS, model_config_from_hf
from fsdp_jax.app.hf.config_moe import moe_json
from fsdp_jax.app.models import families
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.errors import ConfigError


def _rope_dicts(cfg: DecoderConfig) -> tuple[dict, dict | None]:
    """(the 5.x rope_parameters entry, the 4.x rope_scaling dict or None) of global layers."""
    required, optional = ROPE_KEYS[cfg.rope_type]
    always = ("original_max_position_embeddings", "beta_fast", "beta_slow")
    extra = {
        k: getattr(cfg, f)
        for k, f in {**required, **optional}.items()
        if k in required or k in always or getattr(cfg, f) != getattr(DecoderConfig(), f)
    }
    params = {"rope_theta": cfg.rope_theta, "rope_type": cfg.rope_type, **extra}
    return params, (None if cfg.rope_type == "default" else {"rope_type": cfg.rope_type, **extra})


def _family_json(cfg: DecoderConfig, fam: families.Family) -> dict:
    params, scaling = _rope_dicts(cfg)
    d = {
        "architectures": [fam.architectures[0]],
        "model_type": fam.model_type,
        "attention_dropout": 0.0,
        "head_dim": cfg.head_dim,
        fam.activation_key: cfg.mlp_activation,
        "hidden_size": cfg.d_model,
        "initializer_range": 0.02,
        "intermediate_size": cfg.ffn_dim,
        "max_position_embeddings": cfg.max_seq_len,
        "num_attention_heads": cfg.n_heads,
        "num_hidden_layers": cfg.n_layers,
        "num_key_value_heads": cfg.n_kv_heads,
        "rms_norm_eps": cfg.norm_eps,
        "rope_parameters": params,
        "rope_scaling": scaling,
        "rope_theta": cfg.rope_theta,
        "tie_word_embeddings": cfg.tie_word_embeddings,
        "use_cache": True,
        "vocab_size": cfg.vocab_size,
    }
    d.update(fam.json_out(cfg, d))
    if fam.is_moe:
        d.update(moe_json(cfg, fam))
    return d


def family_of(cfg: DecoderConfig, hint: str | None = None) -> families.Family | None:
    """The family whose config.json maps back onto exactly `cfg`'s architecture (the
    model_type `hint` first, e.g. the family the run was imported from), or None."""
    first = families.by_model_type(hint)
    for fam in ([first] if first else []) + list(families.families()):
        try:
            back = model_config_from_hf(_family_json(cfg, fam), "config.json", cfg)
        except ConfigError:
            continue
        if all(getattr(back, f) == getattr(cfg, f) for f in ARCH_FIELDS):
            return fam
    return None


def config_json(cfg: DecoderConfig, dtype: str, token_ids: dict | None = None, hint: str | None = None) -> dict:
    """config.json for `cfg` in its family (keys as transformers writes them, sorted; both
    the 5.x `rope_parameters` and the 4.x `rope_scaling` / `rope_theta`). ConfigError when
    no family computes this architecture."""
    fam = family_of(cfg, hint)
    if fam is None:
        raise ConfigError(
            "model",
            "no Hugging Face family (" + ", ".join(families.model_types()) + ") has this "
            "combination of decoder switches; it cannot be exported",
        )
    d = {**_family_json(cfg, fam), "dtype": dtype, "torch_dtype": dtype, **(token_ids or {})}
    return dict(sorted(d.items()))
