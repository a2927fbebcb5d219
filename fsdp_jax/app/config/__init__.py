"""Typed, frozen run configuration: one dataclass per section, YAML in, YAML out.

    cfg = load_config("configs/tiny.yaml", ["train.steps=20", "mesh.strategy=no_shard"])
    validate(cfg, n_devices=8)      # checks that need the device count
    check_data(cfg)                 # after the trainer prepared the corpus, if it does

Every error is a `ConfigError` whose message is one line naming the dotted key, the
bad value and what is allowed. YAML is read with `yaml.safe_load` only.

- `schema`: the dataclasses, each field's type and limits (`limit`, `check_fields`)
- `parse`:  YAML and `key=value` overrides -> `Config` (did-you-mean for unknown keys)
- `checks`: checks across fields, devices, backend and corpus (`validate`, `check_data`)
- `context_checks`: what context parallelism needs (`check_context`, `RING_FLASH_KERNELS`)
"""

from fsdp_jax.app.config.checks import check_data, validate
from fsdp_jax.app.config.parse import apply_overrides, config_from_dict, config_to_dict, load_config, save_config
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
