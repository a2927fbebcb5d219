"""The run config against FP8 (`precision: ...,matmul=fp8`, docs/fp8.md): the device or planning
target it runs on, and the dtype routed experts compute in. What FP8 trains (`check_fp8`, the
`fp8:` section) needs no JAX: `fsdp_jax.app.config.policy_checks`."""

from __future__ import annotations

import re

import numpy as np

from fsdp_jax.app.config.schema import Config
from fsdp_jax.app.models.grouped_matmul import gpu_misfit, lowering_platform, resolve
from fsdp_jax.errors import ConfigError
from fsdp_jax.quant.fp8 import device_problem
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.targets.tpu import is_tpu


def _fp8(cfg: Config) -> bool:
    return Policy.parse(cfg.precision).matmul == "fp8"


def check_fp8_device(cfg: Config, platform: str, kind: str, compute_capability=None) -> None:
    """matmul=fp8 on a device (or planning target) with FP8 matmul units, or on CPU with
    fp8.emulate (`fsdp_jax.quant.fp8.device_problem`)."""
    if not _fp8(cfg):
        return
    problem = device_problem(platform, kind, compute_capability, cfg.fp8.emulate)
    if problem is not None:
        raise ConfigError("precision", f"{cfg.precision!r} is invalid; {problem}")


def target_platform(target: str | None) -> tuple[str, int]:
    """(platform, TPU generation) a planning target's step is lowered for: a GPU name ("h100")
    "gpu"; a TPU generation or slice ("v5p", "v6e-64") "tpu" and its number; None (no target:
    the planner compiles on this host's CPU) "cpu"."""
    if target is None:
        return "cpu", 0
    if is_tpu(target):
        m = re.match(r"v(\d+)", target)
        return "tpu", int(m.group(1)) if m else 0
    return "gpu", 0


def unscaled_experts(cfg: Config, platform: str | None = None, generation: int = 0) -> str | None:
    """Under `precision ...,matmul=fp8`, the dtype a dropless MoE's grouped expert products run
    in where `model.grouped_matmul` resolves to tokamax's kernels on `platform` (None: this
    process's lowering device): the compute dtype, uncast (`moe_dispatch.fp8_dot`; XLA:GPU expands
    an f8 `ragged_dot` densely, docs/fp8.md "Routed experts"). None where the experts' products
    are FP8 (XLA's `ragged_dot`, capacity mode), without FP8 or routed experts, or where the
    grouped matmul does not resolve here (the step then refuses it in one line)."""
    policy = Policy.parse(cfg.precision)
    if policy.matmul != "fp8" or not cfg.model.n_experts or cfg.model.capacity_factor:
        return None
    try:
        impl = resolve(cfg.model.grouped_matmul, platform=platform, generation=generation)
    except ConfigError:
        return None
    return None if impl == "xla" else np.dtype(policy.compute_dtype).name


def unscaled_kernels(dtype: str, platform: str | None = None) -> str:
    """Which kernels run the unscaled grouped expert products (`unscaled_experts` gave `dtype`)
    on `platform` (None: this process's lowering device): "tokamax", or "xla" (XLA's
    `ragged_dot`, uncast) on a GPU whose tokamax has no kernel for `dtype` operands
    (`grouped_matmul.gpu_misfit`: `auto` falls back so; an explicit `tokamax` is refused there)."""
    platform = lowering_platform() if platform is None else platform
    return "xla" if platform in ("gpu", "cuda") and gpu_misfit(dtype) else "tokamax"


def unscaled_experts_line(cfg: Config, dtype: str, kernels: str = "tokamax") -> str:
    """The one line saying so (`unscaled_experts`, run by `kernels`: `unscaled_kernels`): `plan`'s
    note, the trainer's start line."""
    if kernels == "xla":
        return (
            f"precision matmul=fp8: the routed experts' grouped products run in {dtype} on XLA's ragged_dot "
            f"(model.grouped_matmul=auto: {gpu_misfit(dtype)}; an f8 ragged_dot would be expanded densely, "
            "n_experts x the FLOPs); the projections are FP8. compute=bfloat16 runs them under tokamax's kernels; "
            "model.grouped_matmul: xla or capacity mode (model.capacity_factor > 0) gives FP8 experts (docs/fp8.md)"
        )
    how = "auto resolves to tokamax" if cfg.model.grouped_matmul == "auto" else "tokamax"
    return (
        f"precision matmul=fp8: the routed experts' grouped products run in {dtype} under tokamax's kernels "
        f"(model.grouped_matmul={how}; an f8 ragged_dot would be expanded densely, n_experts x the FLOPs); "
        "the projections are FP8. model.grouped_matmul: xla or capacity mode (model.capacity_factor > 0) "
        "gives FP8 experts (docs/fp8.md)"
    )
