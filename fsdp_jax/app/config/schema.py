"""The run config's schema: one typed, frozen dataclass per section, each field's
type and limits attached to the field itself.

A field with a range carries it as metadata (`limit(default, "> 0")`); `field_problems`
checks a built Config against those limits and the types, and `fsdp_jax.app.config.checks`
adds the cross-field and device checks. Parsing YAML and `key=value` overrides is
`fsdp_jax.app.config.parse`; `fsdp_jax.app.config` re-exports all three.
"""

from __future__ import annotations

import dataclasses
import math
import re
import typing
from collections.abc import Mapping
from typing import Any

from fsdp_jax.app.config.grpo_schema import GrpoConfig
from fsdp_jax.app.config.schema_fields import LIMITS, limit, names
from fsdp_jax.app.models.choices import ATTENTIONS, GROUPED_MATMULS, ROPE_TYPES
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.errors import ConfigError, ShardingError
from fsdp_jax.quant.recipes import RECIPES
from fsdp_jax.sharding.axes import MESH_AXES
from fsdp_jax.sharding.rule_table import DEFAULT_RULES, merge_rules
from fsdp_jax.sharding.thresholds import (
    DEFAULT_MAX_REPLICATED_FRACTION,
    DEFAULT_MIN_REPLICATED_BYTES,
    DEFAULT_MIN_SHARD_SIZE,
)

# The model section is the reference model's own config dataclass (fsdp_jax.app.models),
# which carries no config metadata: its limits are listed here.
MODEL_LIMITS: dict[str, str] = {
    **{
        n: "> 0"
        for n in (
            "vocab_size",
            "d_model",
            "n_layers",
            "n_heads",
            "n_kv_heads",
            "ffn_dim",
            "max_seq_len",
            "rope_theta",
            "norm_eps",
            "rope_factor",
            "rope_low_freq_factor",
            "rope_beta_fast",
            "rope_beta_slow",
            "max_segments",
            "swiglu_limit",
            "swiglu_alpha",
            "routed_scaling_factor",
        )
    },
    **{
        n: "off"
        for n in (
            "sliding_window",
            "global_every",
            "rope_local_theta",
            "attn_softcap",
            "query_pre_attn_scalar",
            "final_softcap",
            "rope_attention_factor",
            "rope_mscale",
            "rope_mscale_all_dim",
            "rope_original_max_len",
            "n_experts",
            "experts_per_token",
            "moe_ffn_dim",
            "shared_expert_ffn_dim",
            "capacity_factor",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "v_head_dim",
            "n_group",
            "topk_group",
            "shared_experts_ffn_dim",
        )
    },
    "decoder_sparse_step": "> 0",
    "router_aux_loss_coef": ">= 0",
    "router_z_loss_coef": ">= 0",
    "bias_update_speed": ">= 0",
    "seq_aux_loss_coef": ">= 0",
    "mtp_depth": ">= 0",
    "mtp_loss_weight": ">= 0",
}
MODEL_CHOICES: dict[str, tuple[str, ...]] = {
    "attention": ATTENTIONS,
    "context_kv_pass": ("all_gather", "ring"),
    "rope_type": tuple(ROPE_TYPES),
    "mlp_activation": ("silu", "gelu_pytorch_tanh"),
    "grouped_matmul": GROUPED_MATMULS,
    "expert_exchange": ("dense", "ragged"),
}

# The model section is the reference model's own config dataclass.
DecoderConfig = DecoderConfig


Rules = dict[str, Any]


def resolved_rules(overrides: Mapping | None = None) -> Rules:
    """`overrides` (logical name -> mesh axis, list of axes, or null) merged over
    `fsdp_jax.sharding.rule_table.DEFAULT_RULES`, in YAML-friendly form (lists, not tuples).
    Raises ConfigError naming mesh.rules.NAME when a value is not a mesh axis."""
    if overrides is not None and not isinstance(overrides, Mapping):
        raise ConfigError(
            "mesh.rules",
            f"{overrides!r} is not a mapping of logical name -> mesh axis (e.g. {{mlp: tensor, embed: fsdp}})",
        )
    out = {}
    for name, value in {**DEFAULT_RULES, **(overrides or {})}.items():
        try:
            merged = merge_rules({name: value}, {})
        except ShardingError:
            raise ConfigError(
                f"mesh.rules.{name}",
                f"{value!r} is invalid; a mesh axis ({', '.join(MESH_AXES)}), a list of them, or null",
            ) from None
        v = merged[str(name)]
        out[str(name)] = list(v) if isinstance(v, tuple) else v
    return out


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    data: int = limit(1, "mesh size")  # each size >= 1, or -1 (one axis) = the remaining devices
    fsdp: int = limit(-1, "mesh size")
    tensor: int = limit(1, "mesh size")
    context: int = limit(1, "mesh size")  # > 1: each sequence split over this many devices (ring attention)
    strategy: str = "full_shard"  # a name of fsdp_jax.sharding.strategy.STRATEGIES or an alias
    min_shard_size: int = limit(DEFAULT_MIN_SHARD_SIZE, ">= 0")  # leaves with fewer elements stay replicated
    max_replicated_fraction: float = limit(DEFAULT_MAX_REPLICATED_FRACTION, "[0, 1]")
    min_replicated_bytes: int = limit(DEFAULT_MIN_REPLICATED_BYTES, ">= 0")  # under this, over the fraction only warns
    # logical name -> mesh axis / list / null, merged over fsdp_jax.sharding.rule_table.DEFAULT_RULES (the
    # resolved table is what the run saves in config.yaml)
    rules: Rules = dataclasses.field(default_factory=resolved_rules)


@dataclasses.dataclass(frozen=True)
class OptimizerConfig:
    name: str = limit("adamw", choices=("adamw", "sgd", "adafactor"))  # adamw | sgd | adafactor
    lr: float = limit(3e-3, "> 0")  # peak; linear warmup then cosine to lr * min_lr_ratio
    warmup_steps: int = limit(50, ">= 0")
    min_lr_ratio: float = limit(0.1, "[0, 1]")
    b1: float = limit(0.9, "[0, 1)")
    b2: float = limit(0.95, "[0, 1)")
    eps: float = limit(1e-8, "> 0")
    weight_decay: float = limit(0.1, ">= 0")
    momentum: float = limit(0.9, "[0, 1)")  # sgd only
    clip_norm: float | None = limit(1.0, "> 0 or null")  # global-norm clipping; null = off


@dataclasses.dataclass(frozen=True)
class DataConfig:
    path: str = "data/stdlib"  # directory with train.bin, val.bin, meta.json
    source: str = limit(
        "stdlib", choices=("stdlib", "none")
    )  # stdlib: prepare the stdlib corpus there if missing; none
    seq_len: int = limit(128, "> 0")
    seed: int = limit(0, ">= 0")
    document_mask: bool = False  # token corpora: attention and positions restart after each EOS


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    steps: int = limit(500, "> 0")
    global_batch: int = limit(16, "> 0")  # sequences per step, over all processes and microbatches
    microbatches: int = limit(1, "> 0")  # gradient accumulation
    seed: int = limit(0, ">= 0")
    log_every: int = limit(10, "> 0")
    eval_every: int = limit(100, "off")  # 0 = never
    eval_batches: int = limit(8, "off")
    checkpoint_every: int = limit(100, "off")  # 0 = only at the end
    keep_checkpoints: int = limit(3, "> 0")
    tensorboard: bool = False
    sample_tokens: int = limit(200, "off")  # generated after training; 0 = none
    max_inflight_steps: int = limit(1, "> 0")  # steps dispatched before blocking on a loss
    max_nonfinite_steps: int = limit(3, "> 0")  # skipped (non-finite) steps in a row before the run stops
    profile: str | None = None  # "START:END": jax.profiler trace of those steps (1-based) -> run_dir/profile


@dataclasses.dataclass(frozen=True)
class LoggingConfig:
    wandb: bool = False  # also log metrics.jsonl's records to Weights & Biases (WANDB_MODE=offline works)
    wandb_project: str = "fsdp_jax"
    wandb_run_name: str | None = None  # null = W&B picks one


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
    coordinator: str | None = None  # host:port of process 0; null = auto-detect (SLURM, Open MPI, ...)
    num_processes: int | None = limit(None, ">= 1 or null")
    process_id: int | None = None
    init_timeout_s: int = limit(300, "> 0")
    peer_timeout_s: float = limit(
        60.0, "peer timeout"
    )  # a peer silent this long stops the others in one line, exit 1; 0 = off


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """LoRA fine-tuning (`fsdp_jax.app.models.lora`): rank 0 trains every param."""

    rank: int = limit(0, "off")  # adapter rank r; 0 = no LoRA (full fine-tuning)
    alpha: float = limit(16.0, "> 0")  # scale alpha / r (alpha / sqrt(r) with rslora)
    rslora: bool = False
    dropout: float = limit(0.0, "[0, 1)")  # PEFT's lora_dropout: on the adapters' input, in training only
    targets: str = names("all-linear")  # all-linear, or PEFT's q_proj k_proj v_proj o_proj gate_proj up_proj down_proj
    #                              shared_expert_gate, gate (DeepSeek-V3's router; or the decoder's wq ... router), spaces or commas,
    #                              or a YAML list: [q_proj, v_proj] (PEFT's target_modules)
    target_parameters: str = names("auto")  # a mixture of experts' fused expert tensors (PEFT's target_parameters):
    #   auto (those the MLP targets name), none, or mlp.experts.gate_up_proj mlp.experts.down_proj
    gate_up_rank: int = limit(0, "off")  # mlp.experts.gate_up_proj's rank (PEFT's rank_pattern, alpha scaled
    #   alike: peft 0.21 writes 2 x rank when target_modules gate_proj / up_proj name the fused experts); 0 = rank
    init_from: str | None = None  # peft:DIR: start from a PEFT adapter (adapter_config.json + safetensors)
    base_quant: str = limit("none", choices=("none", "nf4", "int8"))  # the targets' frozen weights stored
    #   quantised (QLoRA, docs/qlora.md): nf4 (bitsandbytes' NF4, blockwise) or int8 (per output channel)
    quant_block: int = limit(64, "> 0")  # nf4's block (elements per absmax) along each weight's last dim
    double_quant: bool = False  # nf4: quantise the absmax too (bitsandbytes' compress_statistics)


@dataclasses.dataclass(frozen=True)
class Fp8Config:
    """How `precision: ...,matmul=fp8` computes the projections (`fsdp_jax.quant.fp8`, docs/fp8.md)."""

    recipe: str = limit("tensorwise", choices=tuple(RECIPES))  # tensorwise | delayed | rowwise (torchtitan / TE names)
    amax_history: int = limit(16, "> 0")  # delayed: the steps of amax each scale is taken over
    # weights cast to f8 on their shards before the per-layer all-gather (torchtitan's enable_fsdp_float8_all_gather):
    # null = wherever that applies (full_shard / hybrid_shard; projections under tensorwise / delayed, routed experts),
    # true = asked for (refused where it cannot apply), false = off (gathered in the compute dtype, cast after)
    gather: bool | None = None
    emulate: bool = False  # allow FP8 where the device has no FP8 tensor cores (CPU: numerics only)


@dataclasses.dataclass(frozen=True)
class PreferenceConfig:
    """Preference tuning, when `objective` is not sft (`fsdp_jax.app.objectives`, docs/preference.md):
    data.path is then a .jsonl / .parquet / datasets dir of {prompt, chosen, rejected} rows."""

    beta: float = limit(0.1, "> 0")
    label_smoothing: float = limit(0.0, "[0, 0.5)")  # dpo (conservative DPO), simpo
    simpo_gamma: float = 0.5
    cpo_alpha: float = limit(0.0, ">= 0")  # simpo: weight of the chosen NLL (CPO-SimPO); 0 = pure SimPO
    max_length: int = limit(0, "off")  # prompt + completion tokens kept (TRL's max_length); 0 = data.seq_len + 1
    truncation: str = limit("keep_start", choices=("keep_start", "keep_end"))
    tokenizer: str | None = None  # a tokenizer.json (or its dir, with its chat template); null = UTF-8 bytes
    prompt_key: str = "prompt"
    chosen_key: str = "chosen"
    rejected_key: str = "rejected"
    precompute_ref_log_probs: bool = False  # reference log-probs computed once before step 1 (run_dir/ref_logps.npz)
    eval_path: str | None = None  # held-out pairs (as data.path), scored every train.eval_every steps; null = none
    packing: bool = False  # several pairs per row of data.seq_len + 1 tokens, attention kept per sequence by
    #   segment ids (docs/preference.md); train.global_batch then counts packed rows, not pairs


OBJECTIVES = ("sft", "dpo", "ipo", "hinge", "simpo", "orpo", "grpo")


@dataclasses.dataclass(frozen=True)
class Config:
    model: DecoderConfig = DecoderConfig()
    mesh: MeshConfig = MeshConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    data: DataConfig = DataConfig()
    train: TrainConfig = TrainConfig()
    distributed: DistributedConfig = DistributedConfig()
    logging: LoggingConfig = LoggingConfig()
    lora: LoraConfig = LoraConfig()
    preference: PreferenceConfig = PreferenceConfig()
    fp8: Fp8Config = Fp8Config()
    grpo: GrpoConfig = GrpoConfig()
    objective: str = limit(
        "sft", choices=OBJECTIVES
    )  # sft: next-token loss; grpo (docs/grpo.md); else a preference loss
    precision: str = "params=float32,compute=float32"
    remat: str = "dots"
    offload: str = "none"  # none | optimizer | optimizer+params: in host memory; optimizer[+params]:nvme: on disk
    offload_dirs: str = ""  # nvme offloads: comma-separated dirs (local NVMe mounts), striped
    run_dir: str = "runs/tiny"
    xla_gpu_flags: str = limit(
        "none", choices=("none", "fsdp")
    )  # none | fsdp: fsdp_jax.targets.xla_flags.GPU_FSDP_FLAGS (set before start-up)
    init_from: str | None = None  # params to start from: a .safetensors file, run or checkpoint dir,
    # or hf:DIR (a Hugging Face model, docs/hf_models.md; its config.json sets model.*)


SECTIONS: dict[str, type] = {k: t for k, t in typing.get_type_hints(Config).items() if dataclasses.is_dataclass(t)}
# dotted keys that take several names (`names` fields): a string or a YAML list of strings
NAME_LISTS = frozenset(
    f"{s}.{f.name}" for s, t in SECTIONS.items() for f in dataclasses.fields(t) if f.metadata.get("names")
)
_FLOAT_RE = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?")
_INT_LIMIT = 2**31


def all_keys() -> list[str]:
    keys = []
    for f in dataclasses.fields(Config):
        sub = SECTIONS.get(f.name)
        keys += [f"{f.name}.{g.name}" for g in dataclasses.fields(sub)] if sub else [f.name]
    return keys


def field_type(dotted: str) -> Any:
    head, _, tail = dotted.partition(".")
    hints = typing.get_type_hints(Config)
    if head in SECTIONS and tail:
        return typing.get_type_hints(SECTIONS[head]).get(tail)
    return None if tail else hints.get(head)


def coerce(key: str, value: Any, tp: Any) -> Any:
    """Check `value` against the annotation `tp`; int -> float and '3e-3' -> 0.003 for floats."""
    args = typing.get_args(tp)
    if type(None) in args:
        if value is None:
            return None
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is tuple:  # tuple[int, ...]: a YAML list
        if not isinstance(value, (list, tuple)):
            raise ConfigError(key, f"{value!r} is not a list")
        return tuple(coerce(f"{key}[{i}]", v, typing.get_args(tp)[0]) for i, v in enumerate(value))
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(key, f"{value!r} is not a boolean; use true or false")
    if tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            if not -_INT_LIMIT <= value < _INT_LIMIT:  # seeds, sizes and steps reach int32/C long
                raise ConfigError(key, f"{value!r} is out of range; must be in [-2**31, 2**31)")
            return value
        raise ConfigError(key, f"{value!r} is not an integer")
    if tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out = float(value) if abs(value) < 1e308 or isinstance(value, float) else math.inf
        elif isinstance(value, str) and _FLOAT_RE.fullmatch(value.strip()):
            out = float(value)  # PyYAML reads 3e-3 (no dot) as a string
        else:
            raise ConfigError(key, f"{value!r} is not a number")
        if not math.isfinite(out):  # .inf / .nan would only surface as NaN params
            raise ConfigError(key, f"{value!r} is not a finite number")
        return out
    if tp is str:
        if isinstance(value, str):
            return value
        if key in NAME_LISTS and isinstance(value, (list, tuple)):  # [q_proj, v_proj] -> "q_proj v_proj"
            return " ".join(_name(f"{key}[{i}]", v) for i, v in enumerate(value))
        hint = " (quote it in YAML: an unquoted 2:4 reads as a base-60 number)" if isinstance(value, int) else ""
        raise ConfigError(key, f"{value!r} is not a string{hint}")
    if tp == Rules:
        return resolved_rules(value)
    raise TypeError(f"{key}: unsupported annotation {tp!r}")  # a bug here, not in the YAML


def _name(key: str, value: Any) -> str:
    """One element of a `NAME_LISTS` key's YAML list: a non-empty string of one name, or a
    number (token ids, reward weights: `stop_tokens: [10, 13]`)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip() or len(value.replace(",", " ").split()) != 1:
        raise ConfigError(key, f"{value!r} is not a name; the list takes one name per element")
    return value.strip()


def field_limits(cfg: Config):
    """(dotted key, value, limit kind or None, choices or None) of every section field."""
    for section in SECTIONS:
        sub = getattr(cfg, section)
        for f in dataclasses.fields(sub):
            if section == "model":
                kind, choices = MODEL_LIMITS.get(f.name), MODEL_CHOICES.get(f.name)
            else:
                kind, choices = f.metadata.get("limit"), f.metadata.get("choices")
            yield f"{section}.{f.name}", getattr(sub, f.name), kind, choices
    for f in dataclasses.fields(Config):
        if f.name not in SECTIONS:
            yield f.name, getattr(cfg, f.name), f.metadata.get("limit"), f.metadata.get("choices")


def check_fields(cfg: Config) -> None:
    """Each field's type (again: catches a Config(...) built by hand), choices and limit:
    ConfigError naming the first that fails."""
    for section in SECTIONS:
        sub = getattr(cfg, section)
        hints = typing.get_type_hints(type(sub))
        for f in dataclasses.fields(sub):
            coerce(f"{section}.{f.name}", getattr(sub, f.name), hints[f.name])
    for key, v, kind, choices in field_limits(cfg):
        if choices is not None and v not in choices:
            raise ConfigError(key, f"{v!r} is invalid; allowed: {', '.join(choices)}")
        if kind is not None and not LIMITS[kind][0](v):
            raise ConfigError(key, f"{v!r} is invalid; {LIMITS[kind][1]}")
