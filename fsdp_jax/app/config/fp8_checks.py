"""The run config against FP8 (`precision: ...,matmul=fp8`, the `fp8:` section, docs/fp8.md):
what it trains, and the device or planning target it runs on."""

from __future__ import annotations

from fsdp_jax.app.config.schema import Config
from fsdp_jax.errors import ConfigError
from fsdp_jax.quant.fp8 import device_problem
from fsdp_jax.sharding.precision import Policy


def _fp8(cfg: Config) -> bool:
    return Policy.parse(cfg.precision).matmul == "fp8"


def check_fp8(cfg: Config) -> None:
    """matmul=fp8 trains a whole model with the next-token loss (not LoRA, not a preference loss)."""
    if not _fp8(cfg):
        return
    if cfg.lora.rank != 0:
        raise ConfigError(
            "lora.rank", f"{cfg.lora.rank!r} is invalid; must be 0 with precision matmul=fp8 (FP8 trains whole models)"
        )
    if cfg.objective != "sft":
        raise ConfigError("objective", f"{cfg.objective!r} is invalid; must be sft with precision matmul=fp8")


def check_fp8_device(cfg: Config, platform: str, kind: str, compute_capability=None) -> None:
    """matmul=fp8 on a device (or planning target) with FP8 matmul units, or on CPU with
    fp8.emulate (`fsdp_jax.quant.fp8.device_problem`)."""
    if not _fp8(cfg):
        return
    problem = device_problem(platform, kind, compute_capability, cfg.fp8.emulate)
    if problem is not None:
        raise ConfigError("precision", f"{cfg.precision!r} is invalid; {problem}")
