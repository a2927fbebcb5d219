"""`DecoderConfig` -> the Hugging Face config.json of its decoder family (what `fsdp_jax.app.hf.export` writes).

    config_json(cfg, "bfloat16", {"eos_token_id": 2}, hint="mistral")

The family is the one whose config.json maps back onto exactly `cfg`'s architecture
through `fsdp_jax.app.hf.config_in.model_config_from_hf` (the reading direction, with the
family tables), `hint` first; keys as transformers writes them, with both the 5.x
`rope_parameters` and the 4.x `rope_scaling` / top-level `rope_theta`.
"""

from __future__ import annotations

from fsdp_jax.app.hf.config_in import ARCH_FIELDS, FAMILIES, ROPE_KEYS, model_config_from_hf
from fsdp_jax.app.hf.config_moe import MOE_TYPES, moe_json
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


def _int_if_whole(v: float) -> int | float:
    return int(v) if float(v).is_integer() else v  # transformers 5 types it int (strict)


def _family_json(cfg: DecoderConfig, mt: str) -> dict:
    arch, act_key, _ = FAMILIES[mt]
    params, scaling = _rope_dicts(cfg)
    d = {
        "architectures": [arch],
        "model_type": mt,
        "attention_dropout": 0.0,
        "head_dim": cfg.head_dim,
        act_key: cfg.mlp_activation,
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
    n = cfg.n_layers
    if mt == "llama":
        d.update(attention_bias=False, mlp_bias=False, pretraining_tp=1)
    elif mt == "mistral":
        d["sliding_window"] = cfg.sliding_window or None
    elif mt in ("qwen2", "qwen3", "qwen2_moe", "qwen3_moe"):
        d.update(use_sliding_window=False, sliding_window=None, max_window_layers=n, layer_types=["full_attention"] * n)
        if mt in ("qwen3", "qwen3_moe"):
            d["attention_bias"] = False
    elif mt == "gemma3_text":
        every = cfg.global_every if cfg.sliding_window else 1  # 1: every layer full
        types = ["sliding_attention" if cfg.is_local(i) else "full_attention" for i in range(n)]
        local = {"rope_type": "default", "rope_theta": cfg.rope_local_theta or 1e4}
        d.update(
            attention_bias=False,
            layer_types=types,
            sliding_window=cfg.sliding_window or cfg.max_seq_len,
            sliding_window_pattern=every or n + 1,
            rope_parameters={"full_attention": params, "sliding_attention": local},
            rope_local_base_freq=local["rope_theta"],
            query_pre_attn_scalar=_int_if_whole(cfg.query_pre_attn_scalar or cfg.head_dim),
            attn_logit_softcapping=None,
            final_logit_softcapping=cfg.final_softcap or None,
            use_bidirectional_attention=False,
        )
    if mt == "mixtral":
        d["sliding_window"] = cfg.sliding_window or None
    if mt in MOE_TYPES:
        d.update(moe_json(cfg, mt))
    return d


def family_of(cfg: DecoderConfig, hint: str | None = None) -> str | None:
    """The model_type whose config.json maps back onto exactly `cfg`'s architecture
    (`hint` first, e.g. the family the run was imported from), or None."""
    for mt in ([hint] if hint in FAMILIES else []) + list(FAMILIES):
        try:
            back = model_config_from_hf(_family_json(cfg, mt), "config.json", cfg)
        except ConfigError:
            continue
        if all(getattr(back, f) == getattr(cfg, f) for f in ARCH_FIELDS):
            return mt
    return None


def config_json(cfg: DecoderConfig, dtype: str, token_ids: dict | None = None, hint: str | None = None) -> dict:
    """config.json for `cfg` in its family (keys as transformers writes them, sorted; both
    the 5.x `rope_parameters` and the 4.x `rope_scaling` / `rope_theta`). ConfigError when
    no family computes this architecture."""
    mt = family_of(cfg, hint)
    if mt is None:
        raise ConfigError(
            "model",
            "no Hugging Face family (" + ", ".join(FAMILIES) + ") has this "
            "combination of decoder switches; it cannot be exported",
        )
    d = {**_family_json(cfg, mt), "dtype": dtype, "torch_dtype": dtype, **(token_ids or {})}
    return dict(sorted(d.items()))
