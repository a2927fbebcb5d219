"""Typed, frozen run configuration: one dataclass per section, YAML in, YAML out.

    cfg = load_config("configs/tiny.yaml", ["train.steps=20", "mesh.strategy=no_shard"])
    validate(cfg, n_devices=8)      # checks that need the device count
    check_data(cfg)                 # after the trainer prepared the corpus, if it does

Every error is a `ConfigError` whose message is one line naming the dotted key, the
bad value and what is allowed. YAML is read with `yaml.safe_load` only.

- `schema`: the dataclasses, each field's type and limits (`limit`, `check_fields`)
- `read`:   YAML and `key=value` overrides -> `Config`, field by field, no JAX (did-you-mean for unknown keys)
- `parse`:  `read` + `checks` -> a validated `Config` (`load_config`); YAML out
- `checks`: checks across fields, devices, backend and corpus (`validate`, `check_data`)
- `early_checks`: the checks across fields that need no JAX, run first (`check_before_jax`; the CLI's pre-run check)
- `context_checks`: what context parallelism needs (`check_context`, `RING_FLASH_KERNELS`)
"""

from typing import TYPE_CHECKING

from fsdp_jax.lazy_face import lazy_face

if TYPE_CHECKING:  # what static tools see; at run time each name loads on first use
    from fsdp_jax.app.config.checks import check_data, validate
    from fsdp_jax.app.config.parse import config_from_dict, config_to_dict, load_config, save_config
    from fsdp_jax.app.config.read import apply_overrides
    from fsdp_jax.app.config.schema import (
        Config,
        DataConfig,
        DecoderConfig,
        DistributedConfig,
        LoggingConfig,
        MeshConfig,
        OptimizerConfig,
        TrainConfig,
    )
    from fsdp_jax.errors import ConfigError

# module -> the names of the face it defines (loaded on first use: `fsdp_jax.lazy_face`)
_FACE: dict[str, tuple[str, ...]] = {
    "fsdp_jax.app.config.checks": ("check_data", "validate"),
    "fsdp_jax.app.config.parse": ("config_from_dict", "config_to_dict", "load_config", "save_config"),
    "fsdp_jax.app.config.read": ("apply_overrides",),
    "fsdp_jax.app.config.schema": (
        "Config",
        "DataConfig",
        "DecoderConfig",
        "DistributedConfig",
        "LoggingConfig",
        "MeshConfig",
        "OptimizerConfig",
        "TrainConfig",
    ),
    "fsdp_jax.errors": ("ConfigError",),
}
__getattr__, __dir__ = lazy_face(__name__, _FACE)

__all__ = [
    "Config",
    "ConfigError",
    "DataConfig",
    "DistributedConfig",
    "LoggingConfig",
    "MeshConfig",
    "DecoderConfig",
    "OptimizerConfig",
    "TrainConfig",
    "apply_overrides",
    "check_data",
    "config_from_dict",
    "config_to_dict",
    "load_config",
    "save_config",
    "validate",
]
