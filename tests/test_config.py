"""Config loading, overrides and validation: every error names its key."""

from pathlib import Path

import pytest
import yaml

from fsdp_jax.app.config.checks import check_data, validate
from fsdp_jax.app.config.parse import config_from_dict, config_to_dict, load_config, save_config
from fsdp_jax.app.config.schema import Config
from fsdp_jax.app.models import moe, moe_problems
from fsdp_jax.app.models.decoder import count_params
from fsdp_jax.errors import ConfigError
from fsdp_jax.sharding import strategy, strategy_names

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))
TINY = Path(__file__).parent.parent / "configs" / "tiny.yaml"


@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_shipped_configs_load(path):
    cfg = load_config(path)
    assert cfg.data.seq_len <= cfg.model.max_seq_len
    assert config_from_dict(config_to_dict(cfg)) == cfg


def test_shipped_configs_exist():
    assert {p.stem for p in CONFIGS} >= {"tiny", "small", "llama_1b", "llama2_7b"}


def test_tiny_is_the_documented_cpu_default():
    cfg = load_config(TINY)
    validate(cfg, n_devices=8)
    assert (cfg.model.d_model, cfg.model.n_layers, cfg.model.vocab_size) == (256, 4, 256)
    assert cfg.mesh.strategy == "full_shard" and cfg.train.global_batch == 16
    assert cfg.optimizer.lr == 3e-3 and cfg.data.source == "stdlib" and cfg.remat == "dots"


def test_llama2_7b_param_count():
    assert count_params(load_config(CONFIGS[0].parent / "llama2_7b.yaml").model) == 6_738_415_616


def test_overrides_dotted_float_bool_null_and_aliases():
    cfg = load_config(
        TINY,
        [
            "train.steps=20",
            "optimizer.lr=1e-3",
            "optimizer.b2=3e-1",
            "train.tensorboard=true",
            "optimizer.clip_norm=null",
            "strategy=no_shard",
            "precision=params=float32,compute=bfloat16",
            "model.rope_theta=500000",
            "init_from=runs/a: b",
        ],
    )
    assert cfg.train.steps == 20
    assert cfg.optimizer.lr == 1e-3 and isinstance(cfg.optimizer.lr, float)
    assert cfg.optimizer.b2 == 0.3
    assert cfg.train.tensorboard is True and cfg.optimizer.clip_norm is None
    assert cfg.mesh.strategy == "no_shard"
    assert cfg.precision == "params=float32,compute=bfloat16"
    assert cfg.model.rope_theta == 500000.0 and isinstance(cfg.model.rope_theta, float)
    assert cfg.init_from == "runs/a: b"
    assert load_config(TINY, ["steps=7"]).train.steps == 7
    assert load_config(TINY, ["lr=1e-4"]).optimizer.lr == 1e-4


def test_yaml_float_without_dot(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("optimizer:\n  lr: 3e-3\n")  # PyYAML reads this as the string '3e-3'
    assert load_config(p).optimizer.lr == 3e-3


def test_empty_yaml_gives_defaults(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("")
    assert load_config(p) == Config()


@pytest.mark.parametrize(
    "override, key, hint",
    [
        ("train.stpes=3", "train.stpes", "did you mean train.steps"),
        ("optimzer.lr=3", "optimzer.lr", "did you mean optimizer.lr"),
        ("remta=full", "remta", "did you mean remat"),
    ],
)
def test_unknown_override_suggests(override, key, hint):
    with pytest.raises(ConfigError, match=hint) as e:
        load_config(TINY, [override])
    assert e.value.key == key


def test_unknown_key_in_file_suggests(tmp_path):
    p = tmp_path / "c.yaml"
    p.write_text("trian:\n  steps: 3\n")
    with pytest.raises(ConfigError, match="trian: unknown key; did you mean train"):
        load_config(p)
    p.write_text("model:\n  dmodel: 3\n")
    with pytest.raises(ConfigError, match="did you mean model.d_model"):
        load_config(p)


@pytest.mark.parametrize(
    "override, key",
    [
        ("train.steps=abc", "train.steps"),
        ("train.steps=true", "train.steps"),  # bool is not an int
        ("train.steps=2.5", "train.steps"),
        ("optimizer.lr=fast", "optimizer.lr"),
        ("optimizer.lr=true", "optimizer.lr"),
        ("model.scan_layers=1", "model.scan_layers"),
        ("train.steps=0", "train.steps"),
        ("optimizer.lr=-1e-3", "optimizer.lr"),
        ("optimizer.min_lr_ratio=1.5", "optimizer.min_lr_ratio"),
        ("optimizer.warmup_steps=-1", "optimizer.warmup_steps"),
        ("optimizer.name=lion", "optimizer.name"),
        ("model.attention=flash", "model.attention"),
        ("data.source=web", "data.source"),
        ("mesh.strategy=zero4", "mesh.strategy"),
        ("remat=everything", "remat"),
        ("precision=params=float64", "precision"),
        ("precision=compute=int8", "precision"),
        ("model.d_model=250", "model.d_model"),  # not divisible by 4 heads
        ("model.n_kv_heads=3", "model.n_kv_heads"),
        ("data.seq_len=256", "data.seq_len"),  # > max_seq_len 128
        ("train.microbatches=3", "train.global_batch"),
        ("mesh.data=-1", "mesh"),  # two -1 axes
        ("model", "override"),
        ("model=3", "model"),
    ],
)
def test_bad_values_name_the_key(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert e.value.key == key
    msg = str(e.value)
    assert msg.startswith(f"{key}: ") and "\n" not in msg


def test_mesh_rules_merge_over_the_defaults_and_round_trip(tmp_path):
    from fsdp_jax.sharding.rule_table import DEFAULT_RULES

    assert Config().mesh.rules == {k: list(v) if isinstance(v, tuple) else v for k, v in DEFAULT_RULES.items()}
    p = tmp_path / "c.yaml"
    p.write_text("mesh:\n  rules:\n    mlp: fsdp\n    ffw: [fsdp, tensor]\n    vocab: null\n")
    cfg = load_config(p, ["mesh.rules.heads=null", "mesh.rules.embed_dim=fsdp"])
    r = cfg.mesh.rules
    assert (r["mlp"], r["ffw"], r["vocab"], r["heads"], r["embed_dim"]) == (
        "fsdp",
        ["fsdp", "tensor"],
        None,
        None,
        "fsdp",
    )
    assert r["embed"] == "fsdp" and r["batch"] == ["data", "fsdp"]  # untouched defaults stay
    save_config(cfg, tmp_path / "run" / "config.yaml")  # the run saves the resolved table
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["mesh"]["rules"] == r and load_config(tmp_path / "run" / "config.yaml") == cfg


@pytest.mark.parametrize(
    "override, key",
    [
        ("mesh.rules.mlp=model", "mesh.rules.mlp"),  # not a mesh axis
        ("mesh.rules.mlp=[fsdp, fsdp]", "mesh.rules.mlp"),  # an axis twice
        ("mesh.rules.mlp=3", "mesh.rules.mlp"),
        ("mesh.rules=[mlp]", "mesh.rules"),  # not a mapping
        ("mesh.min_replicated_bytes=-1", "mesh.min_replicated_bytes"),
    ],
)
def test_bad_mesh_rules_name_the_rule(override, key):
    with pytest.raises(ConfigError) as e:
        load_config(TINY, [override])
    assert e.value.key == key and "\n" not in str(e.value)
    assert "data, fsdp, context, tensor" in str(e.value) or key != "mesh.rules.mlp"


def test_device_checks():
    cfg = load_config(TINY, ["train.global_batch=12"])  # fine without devices
    with pytest.raises(ConfigError, match="divisible by .*= 8") as e:
        validate(cfg, n_devices=8)
    assert e.value.key == "train.global_batch"
    validate(cfg, n_devices=4)
    cfg = load_config(TINY, ["train.global_batch=16", "train.microbatches=4"])
    with pytest.raises(ConfigError, match="train.global_batch"):
        validate(cfg, n_devices=8)  # 4 per microbatch over 8 devices
    validate(load_config(TINY, ["mesh.data=2", "mesh.fsdp=4"]), n_devices=8)
    with pytest.raises(ConfigError) as e:
        validate(load_config(TINY, ["mesh.fsdp=3"]), n_devices=8)
    assert e.value.key == "mesh"


def test_file_errors_name_the_file(tmp_path):
    with pytest.raises(ConfigError, match="not found") as e:
        load_config(tmp_path / "nope.yaml")
    assert "nope.yaml" in e.value.key
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [1, 2\n")
    with pytest.raises(ConfigError, match="YAML syntax error") as e:
        load_config(bad)
    assert "\n" not in str(e.value)
    bad.write_text("- 1\n- 2\n")
    with pytest.raises(ConfigError, match="top level must be a mapping"):
        load_config(bad)
    bad.write_text("model: 3\n")
    with pytest.raises(ConfigError, match="model: expected a mapping"):
        load_config(bad)


def test_round_trip_through_yaml(tmp_path):
    cfg = load_config(TINY, ["optimizer.clip_norm=null", "init_from=runs/x", "train.steps=9"])
    save_config(cfg, tmp_path / "sub" / "config.yaml")
    assert load_config(tmp_path / "sub" / "config.yaml") == cfg
    assert yaml.safe_load((tmp_path / "sub" / "config.yaml").read_text()) == config_to_dict(cfg)


def test_check_data(tmp_path):
    cfg = load_config(TINY, [f"data.path={tmp_path}", "data.source=none"])
    with pytest.raises(ConfigError, match="train.bin not found") as e:
        check_data(cfg)
    assert e.value.key == "data.path"
    (tmp_path / "train.bin").write_bytes(b"\0\0")
    (tmp_path / "meta.json").write_text('{"vocab_size": 32000}')
    with pytest.raises(ConfigError) as e:
        check_data(cfg)
    assert e.value.key == "model.vocab_size"
    check_data(load_config(TINY, [f"data.path={tmp_path}", "model.vocab_size=32000"]))


def test_resume_names_changed_keys_but_not_keys_older_checkpoints_lack():
    from fsdp_jax.app.trainer.setup import _config_changes

    cfg = load_config(TINY)
    saved = config_to_dict(cfg)
    assert _config_changes(saved, cfg) == []
    old = {k: dict(v) if isinstance(v, dict) else v for k, v in saved.items()}
    del old["offload"], old["logging"], old["train"]["profile"]  # written before these keys existed
    assert _config_changes(old, cfg) == []
    moved = load_config(TINY, ["offload=optimizer", "train.steps=9"])
    [line] = _config_changes(old, moved)
    assert "offload 'none' -> 'optimizer'" in line and f"train.steps {cfg.train.steps} -> 9" in line
    assert "logging" not in line and "profile" not in line


def test_jax_free_names_are_the_librarys():
    """The JAX-free copies the CLI checks before JAX (`config.early_checks`, `config.policy_checks`,
    `planner.flag_values`) are the library's own: the strategy names in the table's order (the
    refusal lists them), the same aliases and MoE check, the remat names in `REMAT_POLICIES`' order,
    the same offload tables, and precision strings read to the `Policy` they parse to (or the same
    error)."""
    from fsdp_jax.app.planner.flag_values import STRATEGY_ORDER, parse_strategies
    from fsdp_jax.nvme import NVME_OFFLOADS
    from fsdp_jax.sharding import offload, offload_settings, precision_names, remat, remat_names
    from fsdp_jax.sharding.precision import Policy

    assert tuple(strategy.STRATEGIES) == strategy_names.STRATEGY_NAMES
    assert strategy.ALIASES is strategy_names.ALIASES
    assert moe.moe_config_problem is moe_problems.moe_config_problem
    assert tuple(remat.REMAT_POLICIES) == remat_names.REMAT_NAMES == remat_names.remat_names()
    assert offload.OFFLOADS is offload_settings.OFFLOADS and NVME_OFFLOADS is offload_settings.NVME_OFFLOADS
    assert sorted(STRATEGY_ORDER) == sorted(strategy.STRATEGIES)
    assert parse_strategies("zero3,DDP,fsdp") == [strategy.get_strategy(n).name for n in ("zero3", "ddp")]
    for name in ("ZeRO3", "hsdp", "shard_opt"):
        assert strategy_names.strategy_name(name) == strategy.get_strategy(name).name
    with pytest.raises(ValueError) as want:
        strategy.get_strategy("zero9")
    with pytest.raises(ValueError) as got:
        strategy_names.strategy_name("zero9")
    assert str(got.value) == str(want.value)
    for text in ("params=float32,compute=bf16", "half", "compute=bfloat16,matmul=FP8,frozen=f16", "matmul=compute"):
        policy = Policy.parse(text)
        names = {f: None if v is None else getattr(v, "name", v) for f, v in vars(policy).items()}
        assert precision_names.parse_fields(text) == names, text
    for bad in ("bogus", "params=float64", "matmul=fp4", "compute=bf16,speed=fast", "frozen=int8"):
        with pytest.raises(ValueError) as want:
            Policy.parse(bad)
        with pytest.raises(ValueError) as got:
            precision_names.parse_fields(bad)
        assert str(got.value) == str(want.value), bad
