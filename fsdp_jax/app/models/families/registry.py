"""The registry of Hugging Face model families: one frozen `Family` record per model_type.

    register(Family("llama", ("LlamaForCausalLM",), ...))
    by_model_type("qwen2").switches                   # {"qkv_bias": True}
    by_architecture("Gemma3ForCausalLM").model_type    # "gemma3_text"

A record holds all a family is (its module in this package fills it): its config.json's
model_type and architectures, the DecoderConfig switches its model_type fixes, how it
reads and writes its own config keys, its weight names and its block parts. Import,
export and PEFT (`fsdp_jax.app.hf`) iterate `families()` in registration order; nothing
outside this package names a family.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable, Mapping
from typing import Any

from fsdp_jax.app.models.parts import DEFAULT_PARTS, BlockParts
from fsdp_jax.errors import ConfigError

# weight names: {our path under a block: (HF name under model.layers.N, layout kind)}
Names = Mapping[str, tuple[str, str]]
WINDOWS = ("none", "never", "all", "pattern")
# transformers' generic expert names (`<prefix>.experts.<e>.<name>.weight`, router `<prefix>.gate`)
GENERIC_EXPERTS = ("mlp", ("gate_proj", "up_proj", "down_proj"))


@dataclasses.dataclass(frozen=True)
class Family:
    """One Hugging Face decoder family.

    model_type     its config.json `model_type`
    architectures  accepted `architectures` entries; the first is what export writes
    activation_key the config key of the MLP activation (hidden_act / hidden_activation)
    defaults       transformers' config defaults for absent keys (rms_norm_eps, rope_theta, ...)
    switches       DecoderConfig fields its model_type fixes (qkv_bias, qk_norm, ...)
    windows        sliding windows: none (refused), never (use_sliding_window refused),
                   all (every layer) or pattern (every N-th layer full, layer-typed RoPE)
    fields_in      (raw, bad, get) -> DecoderConfig fields of its own keys, or None
    json_out       (cfg, the generic config.json) -> its own keys (set over the generic)
    weights        {DecoderConfig switch ("" = always): weight names it brings}
    moe            None (dense), else (raw, bad, n_layers) -> MoE fields; `moe_json` the way out
    moe_names      (MLP prefix, (gate, up, down) names) of its experts, or None: the generic
                   `mlp.experts.N.{gate,up,down}_proj` (`GENERIC_EXPERTS`)
    moe_weights    {DecoderConfig switch: names it brings to a sparse layer} (a shared expert)
    peft_names     {DecoderConfig switch ("" = always): {"<site>/<weight>": PEFT's module under
                   model.layers.N}}, site attn, mlp or shared (a shared expert's); a PEFT
                   `target_modules` name is a module's last part (`peft_targets`)
    peft_parameters those of its `peft_names` ("<site>/<weight>") PEFT reaches only through
                   `target_parameters` ("<module>.weight"): transformers 5's v4 -> v5 conversion
                   makes peft 0.21 rewrite their target_modules names onto the fused experts
    parts          its block parts (`fsdp_jax.app.models.parts.BlockParts`): a config.json of
                   this model_type sets `DecoderConfig.family` to it when they are its own
    part_weights   None, or (cfg) -> {our path under a block: (HF name under model.layers.N,
                   kind, HF shape)} of the params its parts add (import / export name them)
    chat_template  a default chat template (jinja) when its tokenizers ship none, or None
    mtp_key        the config.json key counting its checkpoints' multi-token prediction layers
                   (DeepSeek-V3's `num_nextn_predict_layers`: `fsdp_jax.app.hf.mtp_layout`), or
                   None: MTP modules are not written out, nor read in
    """

    model_type: str
    architectures: tuple[str, ...]
    activation_key: str = "hidden_act"
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    switches: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    windows: str = "none"
    fields_in: Callable | None = None
    json_out: Callable = dataclasses.field(default=lambda cfg, base: {})
    weights: Mapping[str, Names] = dataclasses.field(default_factory=dict)
    moe: Callable | None = None
    moe_json: Callable | None = None
    moe_names: tuple[str, tuple[str, str, str]] | None = None
    moe_weights: Mapping[str, Names] = dataclasses.field(default_factory=dict)
    peft_names: Mapping[str, Mapping[str, str]] = dataclasses.field(default_factory=dict)
    peft_parameters: tuple[str, ...] = ()
    parts: BlockParts = DEFAULT_PARTS
    part_weights: Callable | None = None
    chat_template: str | None = None
    mtp_key: str | None = None

    def __post_init__(self):
        if self.windows not in WINDOWS:
            raise ValueError(f"Family {self.model_type}: windows={self.windows!r} (allowed: {', '.join(WINDOWS)})")
        if not self.architectures:
            raise ValueError(f"Family {self.model_type}: no architectures")

    @property
    def is_moe(self) -> bool:
        return self.moe is not None

    @property
    def own_parts(self) -> bool:
        """Does it build its blocks from parts of its own (then `DecoderConfig.family` names it)?"""
        return self.parts != DEFAULT_PARTS

    def fixes(self, cfg) -> bool:
        """Whether `cfg` has every switch value this family fixes (and its parts: `cfg.family`)."""
        own = cfg.family == (self.model_type if self.own_parts else "")
        return own and all(getattr(cfg, k) == v for k, v in self.switches.items())


# The built-in families, one module each in this package, in registration order. They are
# imported on the registry's first use, not by the package face: LoRA reads the registry when
# it resolves targets, and the family modules import the decoder's parts that import LoRA, so
# importing them with the face made any model module but the decoder a cycle's first entry
# (and `import fsdp_jax.app.models.config` load JAX through the models' face).
BUILT_IN = (
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "gemma3",
    "mixtral",
    "qwen3_moe",
    "qwen2_moe",
    "gpt_oss",
    "deepseek_v3",
)
_REGISTRY: dict[str, Family] = {}
_BUILT_IN_LOADED: list[bool] = []  # [True] once the built-in modules were imported


def _records() -> dict[str, Family]:
    """The registry, the built-in families first (imported and registered on the first call)."""
    if not _BUILT_IN_LOADED:
        _BUILT_IN_LOADED.append(True)
        for name in BUILT_IN:
            family = importlib.import_module(f"{__package__}.{name}").FAMILY
            _REGISTRY[family.model_type] = family
    return _REGISTRY


def register(family: Family) -> Family:
    """Add `family` (ValueError when its model_type is taken); returns it."""
    if family.model_type in _records():
        raise ValueError(f"model_type {family.model_type!r} is already registered")
    _REGISTRY[family.model_type] = family
    return family


def unregister(model_type: str) -> None:
    """Remove a registered family (a test's toy family)."""
    _records().pop(model_type)


def families() -> tuple[Family, ...]:
    """Every registered family, in registration order."""
    return tuple(_records().values())


def model_types() -> tuple[str, ...]:
    return tuple(_records())


def by_model_type(model_type: str) -> Family | None:
    """The family of a config.json's model_type, or None."""
    return _records().get(model_type) if isinstance(model_type, str) else None


def by_architecture(architecture: str) -> Family | None:
    """The family whose export writes `architecture`, else the first that accepts it, or None."""
    fams = families()
    return next((f for f in fams if f.architectures[0] == architecture), None) or next(
        (f for f in fams if architecture in f.architectures), None
    )


def _by_switch(cfg, field: str) -> dict:
    """The names every family's `field` ({switch: names}) brings for each switch `cfg` has on
    ("" = always), in registration order (a later one overrides)."""
    out: dict = {}
    for fam in families():
        for switch, names in getattr(fam, field).items():
            if not switch or getattr(cfg, switch):
                out.update(names)
    return out


def weight_names(cfg) -> dict[str, tuple[str, str]]:
    """One dense layer's {our path: (HF name, kind)} for `cfg`: the names every family
    brings for each switch `cfg` has on, and those its family's parts add (`part_tensors`;
    a sparse MLP part's `moe/...` belong to sparse layers: `fsdp_jax.app.hf.moe_layout`); an
    attention part naming `attn/wo` replaces every `attn/...` name."""
    out = _by_switch(cfg, "weights")
    own = {k: (name, kind) for k, (name, kind, _) in part_tensors(cfg).items() if not k.startswith("moe/")}
    if "attn/wo" in own:  # an attention part that names its o projection names all its tensors
        out = {k: v for k, v in out.items() if not k.startswith("attn/")}
    out.update(own)
    return out


def of_config(cfg) -> Family | None:
    """The family `cfg.family` names (one whose block parts are its own), or None ("")."""
    fam = by_model_type(cfg.family) if cfg.family else None
    if cfg.family and (fam is None or not fam.own_parts):
        own = ", ".join(f.model_type for f in families() if f.own_parts) or "none registered"
        raise ConfigError("model.family", f"{cfg.family!r} is no registered family with parts of its own ({own})")
    return fam


def block_parts(cfg) -> BlockParts:
    """The block parts the decoder for `cfg` is built from: its family's (`cfg.family`), else the default."""
    fam = of_config(cfg)
    return fam.parts if fam else DEFAULT_PARTS


def part_tensors(cfg) -> dict[str, tuple[str, str, tuple[int, ...]]]:
    """{our path under a block: (HF name, kind, HF shape)} of the params `cfg`'s family's parts add."""
    fam = of_config(cfg)
    return dict(fam.part_weights(cfg)) if fam and fam.part_weights else {}


def peft_modules(cfg) -> dict[str, str]:
    """{"<site>/<weight>": PEFT's module under model.layers.N} for `cfg` (`Family.peft_names`)."""
    return _by_switch(cfg, "peft_names")


def peft_parameters(cfg) -> tuple[str, ...]:
    """The "<site>/<weight>" of `cfg` whose PEFT adapters are `target_parameters` (`Family.peft_parameters`)."""
    fam = of_config(cfg)
    return fam.peft_parameters if fam else ()


def peft_targets() -> dict[str, str]:
    """{PEFT target_modules name: the decoder's weight} of every registered family's PEFT
    names, in registration order (q_proj ... down_proj, then what later families add)."""
    out: dict[str, str] = {}
    for fam in families():
        for names in fam.peft_names.values():
            for ours, module in names.items():
                out.setdefault(module.rsplit(".", 1)[-1], ours.rsplit("/", 1)[-1])
    return out


def expert_names(cfg) -> tuple[str, tuple[str, str, str]]:
    """(MLP prefix, expert gate/up/down names) of the first MoE family with names of its own
    whose switches `cfg` has, else `GENERIC_EXPERTS`."""
    own = (f.moe_names for f in families() if f.is_moe and f.moe_names and f.fixes(cfg))
    return next(own, GENERIC_EXPERTS)


def moe_weight_names(cfg) -> dict[str, tuple[str, str]]:
    """What the switches `cfg` has on add to a sparse layer (`Family.moe_weights`)."""
    return _by_switch(cfg, "moe_weights")
