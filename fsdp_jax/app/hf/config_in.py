"""Hugging Face config.json of each decoder family -> `DecoderConfig` (fsdp_jax.app.hf.load uses it).

    cfg = model_config_from_hf(json.load(open("config.json")), "config.json")

Families: the records of `fsdp_jax.app.models.families` (one module per family). What a
family switches on is fixed by its model_type (`Family.switches`: q/k/v biases, q/k norms,
Gemma-style norms and embedding scale; `Family.windows`; its own keys through
`Family.fields_in`); the rest is read from keys.
Both config generations are read: transformers 5.x writes `rope_parameters` (keyed by
layer type for Gemma 3), 4.x `rope_scaling` + top-level `rope_theta` (+ Gemma's
`rope_local_base_freq`); an absent key takes transformers' default for that family
(`Family.defaults`).
Whatever the decoder cannot compute exactly as transformers does is a ConfigError
naming the key (one line). The other way, `DecoderConfig` -> config.json for export, is
`fsdp_jax.app.hf.config_out`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

from fsdp_jax.app.hf.config_moe import moe_fields, refuse_other_router
from fsdp_jax.app.models import families
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.errors import ConfigError

ARCHITECTURES = tuple(f.architectures[0] for f in families.families())
MODEL_TYPES = families.model_types()
# the block switches a family's model_type fixes (`Family.switches`); off unless it does
BLOCK_SWITCHES = ("qkv_bias", "qk_norm", "norm_plus_one", "sandwich_norm", "embed_scale")
SOFTCAP_KEYS = (("attn_logit_softcapping", "attn_softcap"), ("final_logit_softcapping", "final_softcap"))
# DecoderConfig field <- config.json key (after rope/eps defaults are applied)
FIELDS = {
    "vocab_size": "vocab_size",
    "d_model": "hidden_size",
    "n_layers": "num_hidden_layers",
    "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads",
    "ffn_dim": "intermediate_size",
    "max_seq_len": "max_position_embeddings",
    "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps",
    "tie_word_embeddings": "tie_word_embeddings",
}
# every architecture field of DecoderConfig (what a checkpoint decides; not scan_layers/attention)
# (capacity_factor, the router z-loss, the balancing speed and alpha, the grouped-matmul kernel and the exchange are training options
# a checkpoint does not record)
# (and multi-token prediction: a run may train fewer MTP depths than a checkpoint holds, as transformers loads none)
_RUN_FIELDS = (
    "scan_layers",
    "attention",
    "capacity_factor",
    "router_z_loss_coef",
    "bias_update_speed",
    "seq_aux_loss_coef",
    "grouped_matmul",
    "expert_exchange",
    "mtp_depth",
    "mtp_loss_weight",
)
ARCH_FIELDS = tuple(f.name for f in dataclasses.fields(DecoderConfig) if f.name not in _RUN_FIELDS)
# rope dict keys -> DecoderConfig field, per rope type (required keys first)
ROPE_KEYS = {
    "linear": ({"factor": "rope_factor"}, {}),
    "llama3": (
        {
            "factor": "rope_factor",
            "low_freq_factor": "rope_low_freq_factor",
            "high_freq_factor": "rope_high_freq_factor",
            "original_max_position_embeddings": "rope_original_max_len",
        },
        {},
    ),
    "yarn": (
        {"factor": "rope_factor"},
        {
            "original_max_position_embeddings": "rope_original_max_len",
            "beta_fast": "rope_beta_fast",
            "beta_slow": "rope_beta_slow",
            "attention_factor": "rope_attention_factor",
            "mscale": "rope_mscale",
            "mscale_all_dim": "rope_mscale_all_dim",
            "truncate": "rope_truncate",
        },
    ),
    "default": ({}, {}),
}


def _rope_fields(r: Mapping, key: str, bad, max_pos: int) -> dict:
    """DecoderConfig rope fields of one rope dict (`key` names it in errors)."""
    if not isinstance(r, Mapping):
        raise bad(key, "expected an object {rope_type, rope_theta, ...}")
    kind = r.get("rope_type", r.get("type", "default"))
    if kind not in ROPE_KEYS:
        raise bad(key, f"rope_type {kind!r} is not implemented (allowed: {', '.join(ROPE_KEYS)})")
    required, optional = ROPE_KEYS[kind]
    out: dict[str, Any] = {"rope_type": kind}
    for k, field in {**required, **optional}.items():
        v = r.get(k)
        if v is None:
            if k in required:
                raise bad(key, f"rope_type {kind} needs {k}")
            continue
        ok = (
            isinstance(v, bool)
            if field == "rope_truncate"
            else (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0)
        )
        if not ok:
            raise bad(key, f"{k}={v!r} is invalid (a positive number)")
        out[field] = v if field == "rope_truncate" else (int(v) if field == "rope_original_max_len" else float(v))
    if kind == "yarn":
        out.setdefault("rope_original_max_len", max_pos)
    known = {"rope_type", "type", "rope_theta", "partial_rotary_factor", *required, *optional}
    extra = [k for k, v in r.items() if k not in known and v is not None]
    if extra:
        raise bad(key, f"{extra[0]} is not implemented for rope_type {kind}")
    if float(r.get("partial_rotary_factor", 1.0) or 1.0) != 1.0:
        raise bad(key, "partial_rotary_factor: RoPE rotates the whole head (allowed: 1)")
    return out


def _number(raw: Mapping, key: str, default: float, bad) -> float:
    """A finite number (None: `default`), else bad(key, ...)."""
    v = raw.get(key, default)
    v = default if v is None else v
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise bad(key, "expected a finite number")
    return float(v)


def _family_fields(raw: Mapping, fam: families.Family, bad, n_layers: int) -> dict:
    """The decoder switches `raw` (of family `fam`) sets, as DecoderConfig fields: those
    of the MLP and attention blocks, the family's own keys, then the sliding windows
    (checked in that order: the first refused key is named)."""
    get = lambda k: raw.get(k, fam.defaults.get(k))  # noqa: E731
    out = _block_fields(raw, fam, bad, get(fam.activation_key))
    out.update(_own_fields(raw, fam, bad, get))
    out.update(_window_fields(raw, fam, bad, get, n_layers))
    out["family"] = fam.model_type if fam.own_parts else ""
    return out


def _block_fields(raw: Mapping, fam: families.Family, bad, act) -> dict:
    """The MLP and attention switches: activation, biases, norms (no dropout, full RoPE)."""
    out: dict[str, Any] = {}
    act = act or "silu"
    if act not in ("silu", "gelu_pytorch_tanh"):
        raise bad(fam.activation_key, "the decoder's gated MLP has silu or gelu_pytorch_tanh")
    out["mlp_activation"] = act
    if raw.get("mlp_bias", False):
        raise bad("mlp_bias", "the decoder's MLP has no biases")
    if raw.get("attention_bias", False) and not fam.own_parts:  # a family with parts reads it (fields_in)
        raise bad("attention_bias", "an o_proj bias is not implemented (q/k/v biases are: Qwen2)")
    if _number(raw, "attention_dropout", 0.0, bad) != 0.0:
        raise bad("attention_dropout", "the decoder has no dropout (allowed: 0)")
    if _number(raw, "partial_rotary_factor", 1.0, bad) != 1.0:
        raise bad("partial_rotary_factor", "RoPE rotates the whole head (allowed: 1)")
    out.update(dict.fromkeys(BLOCK_SWITCHES, False))
    out.update(fam.switches)
    return out


def _own_fields(raw: Mapping, fam: families.Family, bad, get) -> dict:
    """The family's own keys (`Family.fields_in`); without it, logit soft-capping is refused."""
    if fam.fields_in is not None:
        return fam.fields_in(raw, bad, get)
    out: dict[str, Any] = {}
    for key, field in SOFTCAP_KEYS:
        if raw.get(key) is not None:
            raise bad(key, f"not read by {fam.model_type} models (allowed: null)")
        out[field] = 0.0
    return out


def _window_fields(raw: Mapping, fam: families.Family, bad, get, n_layers: int) -> dict:
    """sliding_window and global_every (`Family.windows` pattern: every N-th layer full), or
    {} when every layer attends over the whole sequence."""
    window = get("sliding_window")
    if fam.windows == "never":
        if raw.get("use_sliding_window", False):
            raise bad(
                "use_sliding_window",
                "Qwen's per-layer windows (max_window_layers) are not implemented (allowed: false)",
            )
        window = None
    elif fam.windows == "none" and window is not None:
        raise bad("sliding_window", "Llama attends over the whole sequence (allowed: null)")
    types = raw.get("layer_types")
    if window is None:
        if types is not None and any(t != "full_attention" for t in types):
            raise bad("layer_types", "sliding layers need a sliding_window")
        return {}
    if not isinstance(window, int) or isinstance(window, bool) or window < 1:
        raise bad("sliding_window", "expected a positive integer or null")
    max_pos = raw.get("max_position_embeddings", 2048)
    if isinstance(max_pos, int) and window > max_pos:
        raise bad("sliding_window", f"larger than the context (max_position_embeddings={max_pos})")
    every = 0
    if fam.windows == "pattern":
        if types is None:
            p = get("sliding_window_pattern")
            types = ["sliding_attention" if (i + 1) % p else "full_attention" for i in range(n_layers)]
        if (
            not isinstance(types, list)
            or len(types) != n_layers
            or any(t not in ("sliding_attention", "full_attention") for t in types)
        ):
            raise bad("layer_types", f"expected {n_layers} of sliding_attention / full_attention")
        full = [i for i, t in enumerate(types) if t == "full_attention"]
        if len(full) == n_layers:
            return {}
        every = full[0] + 1 if full else 0
        want = ["full_attention" if every and (i + 1) % every == 0 else "sliding_attention" for i in range(n_layers)]
        if types != want:
            raise bad(
                "layer_types", "the decoder's layer pattern is every N-th layer full (Gemma 3's sliding_window_pattern)"
            )
    elif types is not None and any(t != "sliding_attention" for t in types):
        raise bad("layer_types", "a window on some layers only is Gemma 3's pattern")
    return {"sliding_window": window, "global_every": every}


def _rope_of(raw: Mapping, fam: families.Family, bad, max_pos: int):
    """(rope fields, rope_theta, the sliding layers' theta or None) of an HF config: 5.x
    rope_parameters (flat, or keyed by layer type for a `pattern` family), or 4.x
    rope_scaling + rope_theta (+ rope_local_base_freq)."""
    defaults = fam.defaults
    rope = raw.get("rope_parameters")
    scaling = raw.get("rope_scaling")
    local_theta = None
    if rope is not None and not isinstance(rope, Mapping):
        raise bad("rope_parameters", "expected an object {rope_type, rope_theta, ...}")
    if rope and fam.windows == "pattern" and ("full_attention" in rope or "sliding_attention" in rope):
        loc = rope.get("sliding_attention") or {}
        if loc.get("rope_type", loc.get("type", "default")) != "default":
            raise bad("rope_parameters", "sliding_attention layers' rope_type must be default")
        local_theta = loc.get("rope_theta")
        rope = rope.get("full_attention") or {}
    if rope:
        rope_kw = _rope_fields(rope, "rope_parameters", bad, max_pos)
        if scaling and _rope_fields(scaling, "rope_scaling", bad, max_pos) != rope_kw:
            raise bad("rope_scaling", "disagrees with rope_parameters")
        theta = rope.get("rope_theta", raw.get("rope_theta", defaults["rope_theta"]))
        if "rope_theta" in rope and raw.get("rope_theta") is not None and raw["rope_theta"] != theta:
            raise bad("rope_theta", f"disagrees with rope_parameters.rope_theta={theta!r}")
    else:
        rope_kw = _rope_fields(scaling, "rope_scaling", bad, max_pos) if scaling else {}
        theta = raw.get("rope_theta", defaults["rope_theta"])
    if fam.windows == "pattern" and local_theta is None:
        local_theta = raw.get("rope_local_base_freq", defaults.get("rope_local_base_freq", theta))
    return rope_kw, theta, local_theta


def model_config_from_hf(
    raw: Mapping, where: str = "config.json", base: DecoderConfig = DecoderConfig()
) -> DecoderConfig:
    """DecoderConfig for an HF config dict of any registered family; non-architecture
    fields (scan_layers, attention) come from `base`. ConfigError(`where`, ...) names
    the refused field."""

    def bad(key, why):
        return ConfigError(where, f"{key}={raw.get(key)!r}: {why}")

    mt = raw.get("model_type")
    refuse_other_router(mt, bad)  # DeepSeek, gpt-oss, ...: by name
    fam = families.by_model_type(mt)
    if fam is None:
        raise bad("model_type", f"not a supported decoder family (allowed: {', '.join(families.model_types())})")
    arch = raw.get("architectures") or []
    if not isinstance(arch, list):
        raise bad("architectures", "expected a list of class names")
    if any(a not in fam.architectures for a in arch):
        raise bad("architectures", f"allowed for model_type {mt}: {', '.join(sorted(fam.architectures))}")
    defaults = fam.defaults
    raw = {
        **{k: v for k, v in defaults.items() if k not in ("rope_theta", "rope_local_base_freq")},
        **raw,
    }  # what transformers' config class fills in for an absent key
    max_pos = raw.get("max_position_embeddings", 2048)
    rope_kw, theta, local_theta = _rope_of(raw, fam, bad, max_pos)
    vals = {
        "rope_theta": theta,
        "rms_norm_eps": raw.get("rms_norm_eps", defaults["rms_norm_eps"]),
        "tie_word_embeddings": raw.get("tie_word_embeddings", defaults.get("tie_word_embeddings", False)),
        "num_key_value_heads": raw.get("num_key_value_heads") or raw.get("num_attention_heads"),
        "max_position_embeddings": max_pos,
    }
    kw: dict[str, Any] = {}
    for field, key in FIELDS.items():
        v = vals[key] if key in vals else raw.get(key)
        if v is None:
            raise ConfigError(where, f"{key}: missing (a {mt} config.json has it)")
        want = type(getattr(base, field))
        ok = (
            isinstance(v, bool)
            if want is bool
            else isinstance(v, (int, float))
            and not isinstance(v, bool)
            and 0 < v < 2**31
            and math.isfinite(v)
            and (want is float or float(v).is_integer())
        )
        if not ok:
            raise ConfigError(
                where,
                f"{key}={v!r}: expected a "
                f"{'boolean' if want is bool else 'finite positive number below 2**31'}"
                f"{'' if want is not int else ', an integer'}",
            )
        kw[field] = want(v)
    if kw["n_heads"] % kw["n_kv_heads"]:
        raise ConfigError(
            where,
            f"num_attention_heads={kw['n_heads']}, num_key_value_heads={kw['n_kv_heads']}: kv heads must divide heads",
        )
    hd = raw.get("head_dim", defaults.get("head_dim"))
    if hd is not None:
        if not isinstance(hd, int) or isinstance(hd, bool) or hd < 2 or hd % 2:
            raise bad("head_dim", "expected an even positive integer")
        if kw["d_model"] % kw["n_heads"] or hd != kw["d_model"] // kw["n_heads"]:
            kw["kv_channels"] = hd
    elif kw["d_model"] % kw["n_heads"]:
        raise bad("num_attention_heads", f"must divide hidden_size={kw['d_model']} (or set head_dim)")
    kw.update(rope_kw)
    kw.update(_family_fields(raw, fam, bad, kw["n_layers"]))
    kw.update(moe_fields(raw, fam, bad, kw["n_layers"]))
    if kw.get("global_every"):
        kw["rope_local_theta"] = float(local_theta)
    defaults_of = {f: getattr(DecoderConfig(), f) for f in ARCH_FIELDS if f not in FIELDS}
    cfg = dataclasses.replace(base, **{**defaults_of, **kw})
    if cfg.rope_type == "llama3" and not cfg.rope_high_freq_factor > cfg.rope_low_freq_factor:
        raise bad("rope_parameters", "llama3 needs high_freq_factor > low_freq_factor")
    return cfg
