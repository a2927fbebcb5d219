"""The checks across a run config's fields that need no JAX, in `checks.validate`'s order:
heads vs kv heads and head dim, the decoder's family switches, the MoE fields, the data fields,
run_dir, the mesh sizes and strategy name, then the policies (`policy_checks`: remat, offload,
distributed, precision, train), multi-token prediction (`mtp_checks`), FP8 and cuDNN attention's
compute dtype. The CLI runs them (`check_before_jax`, from
`fsdp_jax.app.cli.args.config_agrees_before_jax`) so such a refusal comes before JAX loads;
`checks.validate` runs them again, then the rest (LoRA against the decoder, the device count).
Every failure is a one-line ConfigError naming the dotted key, the value and what is allowed.
"""

from __future__ import annotations

from fsdp_jax.app.config.mtp_checks import check_mtp
from fsdp_jax.app.config.policy_checks import check, check_attention_precision, check_fp8, check_policies
from fsdp_jax.app.config.schema import Config
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.moe_problems import moe_config_problem
from fsdp_jax.sharding.strategy_names import ALIASES, STRATEGY_NAMES


def check_before_jax(cfg: Config) -> None:
    """The checks across fields that need no JAX (after `schema.check_fields`); the first
    failure is raised."""
    _check_heads(cfg.model)
    _check_decoder(cfg.model)
    _check_moe(cfg.model)
    _check_data_fields(cfg)
    _check_run_dir(cfg)
    _check_mesh(cfg)
    check_policies(cfg)  # remat, offload, distributed, precision, train
    check_mtp(cfg)
    check_fp8(cfg)
    check_attention_precision(cfg)


def _check_heads(m: DecoderConfig) -> None:
    """Heads, kv heads and head dim agree with each other and with d_model."""
    check(
        m.kv_channels > 0 or m.d_model % m.n_heads == 0,
        "model.d_model",
        m.d_model,
        f"must be divisible by model.n_heads={m.n_heads} (or set model.kv_channels)",
    )
    check(m.n_heads % m.n_kv_heads == 0, "model.n_kv_heads", m.n_kv_heads, f"must divide model.n_heads={m.n_heads}")
    check(m.kv_channels >= 0, "model.kv_channels", m.kv_channels, "must be >= 0 (0 = d_model/n_heads)")
    check(
        m.head_dim % 2 == 0,
        "model.kv_channels" if m.kv_channels else "model.d_model",
        m.kv_channels or m.d_model,
        f"head dim {m.head_dim} must be even for RoPE",
    )


def _check_decoder(m: DecoderConfig) -> None:
    """How the family switches of the decoder combine (docs/hf_models.md)."""
    check(
        m.global_every == 0 or m.sliding_window > 0,
        "model.global_every",
        m.global_every,
        "a layer pattern needs model.sliding_window > 0",
    )
    check(
        m.rope_local_theta == 0 or m.global_every > 0,
        "model.rope_local_theta",
        m.rope_local_theta,
        "only sliding layers of a pattern (model.global_every > 0) use it",
    )
    check(
        m.rope_high_freq_factor > m.rope_low_freq_factor,
        "model.rope_high_freq_factor",
        m.rope_high_freq_factor,
        f"must be > model.rope_low_freq_factor={m.rope_low_freq_factor}",
    )
    if m.rope_type in ("llama3", "yarn"):
        check(
            m.rope_original_max_len > 0,
            "model.rope_original_max_len",
            m.rope_original_max_len,
            f"rope_type {m.rope_type} needs the original context length (> 0)",
        )


def _check_moe(m: DecoderConfig) -> None:
    problem = moe_config_problem(m)
    if problem is not None:
        check(False, f"model.{problem[0]}", problem[1], problem[2])


def _check_data_fields(cfg: Config) -> None:
    """The sequence fits the model's context; data.path names a directory."""
    data, m = cfg.data, cfg.model
    check(data.seq_len <= m.max_seq_len, "data.seq_len", data.seq_len, f"must be <= model.max_seq_len={m.max_seq_len}")
    check(bool(data.path.strip()), "data.path", data.path, "must be a directory path")


def _check_run_dir(cfg: Config) -> None:
    """run_dir names a directory (an empty one would be the current directory)."""
    check(
        bool(cfg.run_dir.strip()),
        "run_dir",
        cfg.run_dir,
        "must be a directory path (not empty: the run would write into the current directory)",
    )


def _check_mesh(cfg: Config) -> None:
    """At most one mesh size is -1 (the rest of the devices); the strategy exists."""
    mesh = cfg.mesh
    sizes = (mesh.data, mesh.fsdp, mesh.context, mesh.tensor)
    check(
        sizes.count(-1) <= 1,
        "mesh",
        dict(zip(("data", "fsdp", "context", "tensor"), sizes)),
        "at most one of data, fsdp, context, tensor may be -1",
    )
    check(
        mesh.strategy.lower() in STRATEGY_NAMES or mesh.strategy.lower() in ALIASES,
        "mesh.strategy",
        mesh.strategy,
        f"allowed: {', '.join(STRATEGY_NAMES)} (aliases: {', '.join(ALIASES)})",
    )
