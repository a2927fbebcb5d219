"""The run config against multi-token prediction (`model.mtp_depth`, docs/hf_models.md): a
next-token objective whose rows are in order."""

from __future__ import annotations

from fsdp_jax.app.config.schema import Config
from fsdp_jax.errors import ConfigError


def check_mtp(cfg: Config) -> None:
    """mtp_depth > 0: objective sft, mesh.context 1 (depth k shifts a row by k), fewer depths than
    the sequence has tokens."""
    d = cfg.model.mtp_depth
    if not d:
        return
    if cfg.objective != "sft":
        raise ConfigError(
            "model.mtp_depth", f"{d!r} is invalid; is a next-token objective's (objective sft, not {cfg.objective})"
        )
    if cfg.mesh.context != 1:
        raise ConfigError("model.mtp_depth", f"{d!r} is invalid; shifts rows in order: needs mesh.context 1")
    if d >= cfg.data.seq_len:
        raise ConfigError("model.mtp_depth", f"{d!r} is invalid; must be < data.seq_len={cfg.data.seq_len}")
