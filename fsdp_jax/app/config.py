"""Typed, frozen run configuration: one dataclass per section, YAML in, YAML out.

    cfg = load_config("configs/tiny.yaml", ["train.steps=20", "mesh.strategy=no_shard"])
    validate(cfg, n_devices=8)      # checks that need the device count
    check_data(cfg)                 # after the trainer prepared the corpus, if it does

Every error is a `ConfigError` whose message is one line naming the dotted key, the
bad value and what is allowed. YAML is read with `yaml.safe_load` only.

Three modules, re-exported here: `config_schema` (the dataclasses, each field's type
and limits), `config_parse` (YAML and `key=value` overrides -> Config) and
`config_checks` (checks across fields, devices, backend and corpus).
"""

from fsdp_jax.app.config_checks import (  # noqa: F401
    _check,
    _check_decoder,
    check_backend,
    check_coordinator,
    check_data,
    parse_profile,
    validate,
)
from fsdp_jax.app.config_parse import (  # noqa: F401
    _OVERRIDE_ALIASES,
    _PATH_KEYS,
    _build,
    _unknown,
    apply_overrides,
    config_from_dict,
    config_to_dict,
    expand_user_paths,
    load_config,
    save_config,
)
from fsdp_jax.app.config_schema import (  # noqa: F401
    _FLOAT_RE,
    _INT_LIMIT,
    _SECTIONS,
    LIMITS,
    MODEL_CHOICES,
    MODEL_LIMITS,
    Config,
    DataConfig,
    DistributedConfig,
    LoggingConfig,
    MeshConfig,
    ModelConfig,
    OptimizerConfig,
    Rules,
    TrainConfig,
    _all_keys,
    _coerce,
    _field_type,
    check_fields,
    field_limits,
    limit,
    resolved_rules,
)
from fsdp_jax.app.models.llama import LlamaConfig, count_params  # noqa: F401 (re-exported)
from fsdp_jax.errors import ConfigError  # noqa: F401 (re-exported)

# field -> allowed values, for the fields that have a fixed set (the schema carries them)
_CHOICES = {
    **{f"model.{k}": v for k, v in MODEL_CHOICES.items()},
    **{k: c for k, _, _, c in field_limits(Config()) if c is not None},
}
