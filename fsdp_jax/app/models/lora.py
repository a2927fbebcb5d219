"""LoRA adapters on the reference decoder's projections, in the factored form.

    y = x W + scale * (dropout(x) A) B   A: (in..., r) drawn as PEFT does, B: (r, out...) zero

A projection with an adapter computes its frozen weight's product and the adapter's two
thin products separately, so the backward computes `x`'s gradient through `W` and the
adapters' gradients, never a gradient of `W`'s shape (`fsdp_jax.sharding.precision.matmul`
skips the weight-gradient dot of a weight the step does not differentiate). Merging
(`W + scale * A B`, `merged`) is for export only.

Adapters name their dims by their weight's: A's input dims take the weight's input names,
B's output dims the weight's output names, and the rank dim `lora_rank`, replicated in the
rules table; so each shards with its weight under every strategy and FSDP x TP.

`LoraSpec` is what the decoder needs (rank, scale, targets); the run config's `lora:`
section (`fsdp_jax.app.config.schema.LoraConfig`) resolves to it. Adapters are created
after every other param of a block, so a model with adapters draws its base params
exactly as one without (`Llama(cfg, rngs=nnx.Rngs(0))` has the same base either way).

Dropout (`LoraSpec.dropout`, PEFT's `lora_dropout`) acts on the adapter's input only, and
only when the decoder is given a dropout key (the train step's; eval, verify and logits
run without). Its masks come from the key alone: the key of layer `l` is
`fold_in(key, l)` (`layer_keys`), of weight `w` in it `fold_in(that, WEIGHTS.index(w))`,
and the mask keeps each element of the input rows with probability 1 - p (`keep_mask`),
so they are the same on one device and on N, under every strategy.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from fsdp_jax.model.lora import a_init
from fsdp_jax.sharding.axes import EMBED, EXPERT, HEADS, KV, KV_HEADS, LORA_RANK, MLP
from fsdp_jax.sharding.leaf_sharding import path_str
from fsdp_jax.sharding.precision import matmul

# PEFT's module names -> the decoder's weights
PEFT_TARGETS: dict[str, str] = {
    "q_proj": "wq",
    "k_proj": "wk",
    "v_proj": "wv",
    "o_proj": "wo",
    "gate_proj": "w_gate",
    "up_proj": "w_up",
    "down_proj": "w_down",
}
ATTENTION = ("wq", "wk", "wv", "wo")
WEIGHTS = tuple(PEFT_TARGETS.values())
ADAPTER_LEAVES = ("lora_a", "lora_b")


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """rank r, alpha, rslora (scale alpha / sqrt(r), else alpha / r), and the target
    weights (the decoder's names, `WEIGHTS` order). `init_weights`: PEFT's
    `init_lora_weights`; True (its default) starts B at zero, so step 0 is the base; False
    draws B as torch's nn.Linear(r, out) does, like A (PEFT's choice for tests: an adapter
    that is not a no-op; `verify` uses it, see `fsdp_jax.app.cli.verify`)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = WEIGHTS
    rslora: bool = False
    dropout: float = 0.0  # on the adapters' input, in training only
    init_weights: bool = True

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


def resolve_targets(spec: str) -> tuple[str, ...]:
    """`"all-linear"` or names (PEFT's `q_proj ...` or the decoder's `wq ...`, separated by
    spaces or commas) -> the decoder's weight names in `WEIGHTS` order. ValueError naming the
    unknown names and listing the ones that exist."""
    names = [n for n in spec.replace(",", " ").split() if n]
    if names == ["all-linear"]:
        return WEIGHTS
    ours = {PEFT_TARGETS.get(n, n) for n in names}
    unknown = [n for n in names if PEFT_TARGETS.get(n, n) not in WEIGHTS]
    if unknown or not names:
        raise ValueError(
            f"{' '.join(unknown) or repr(spec)} matches no weight; the targets are all-linear, "
            f"{' '.join(PEFT_TARGETS)} (or {' '.join(WEIGHTS)})"
        )
    return tuple(w for w in WEIGHTS if w in ours)


def spec_from_config(section) -> LoraSpec | None:
    """The run config's `lora:` section (rank, alpha, targets, rslora, dropout) as a
    `LoraSpec`; None for rank 0 (no LoRA)."""
    if not section.rank:
        return None
    return LoraSpec(section.rank, section.alpha, resolve_targets(section.targets), section.rslora, section.dropout)


def weight_dims(cfg, name: str) -> tuple[tuple[int, ...], tuple[str, ...], tuple[int, ...], tuple[str, ...]]:
    """(input shape, input names, output shape, output names) of the decoder's weight `name`."""
    d, h, kvh, dh, f = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim
    return {
        "wq": ((d,), (EMBED,), (h, dh), (HEADS, KV)),
        "wk": ((d,), (EMBED,), (kvh, dh), (KV_HEADS, KV)),
        "wv": ((d,), (EMBED,), (kvh, dh), (KV_HEADS, KV)),
        "wo": ((h, dh), (HEADS, KV), (d,), (EMBED,)),
        "w_gate": ((d,), (EMBED,), (f,), (MLP,)),
        "w_up": ((d,), (EMBED,), (f,), (MLP,)),
        "w_down": ((f,), (MLP,), (d,), (EMBED,)),
    }[name]


# the experts' adapters, as PEFT puts them on transformers' fused expert tensors (its
# `target_parameters`: `mlp.experts.gate_up_proj` (E, 2F, D) and `mlp.experts.down_proj`
# (E, D, F)): gate and up share one adapter, its B producing both halves (gate first)
EXPERT_ADAPTERS: dict[str, tuple[str, ...]] = {"experts_gate_up": ("w_gate", "w_up"), "experts_down": ("w_down",)}


def expert_targets(cfg, targets: tuple[str, ...]) -> str | None:
    """None, or the one line refusing `targets` on a mixture-of-experts model: the experts'
    gate and up projections are one fused tensor (transformers' gate_up_proj), so an adapter
    takes both or neither; a shared expert (Qwen2-MoE) is not adapted (so MLP targets there,
    which PEFT would also put on it, are refused). Dense MLP layers beside the experts
    (`mlp_only_layers`) keep none: the MLP targets name the experts' tensors."""
    mlp = [t for t in targets if t not in ATTENTION]
    if not cfg.n_experts or not mlp:
        return None
    if ("w_gate" in mlp) != ("w_up" in mlp):
        return (
            "gate_proj and up_proj are one fused tensor per expert (transformers' experts.gate_up_proj, "
            "one PEFT adapter): target both or neither"
        )
    if cfg.shared_expert_ffn_dim:
        return (
            f"{' '.join(_peft_names(mlp))} on a model with a shared expert (Qwen2-MoE): adapters on its "
            "experts and its shared expert are not built; target the attention projections, "
            "q_proj k_proj v_proj o_proj"
        )
    return None


def expert_dropout(cfg, spec: "LoraSpec") -> str | None:
    """None, or the line refusing dropout with adapters on experts (PEFT's ParamWrapper has none)."""
    if cfg.n_experts and spec.dropout and any(t not in ATTENTION for t in spec.targets):
        return "adapters on experts take no dropout (PEFT's target_parameters refuse lora_dropout): set lora.dropout=0"
    return None


def _peft_names(ours) -> list[str]:
    peft = {v: k for k, v in PEFT_TARGETS.items()}
    return [peft[t] for t in ours]


def expert_adapter_dims(cfg, name: str) -> tuple[int, str, int, str]:
    """(in width, in name, out width, out name) of expert adapter `name` (`EXPERT_ADAPTERS`)."""
    d, f = cfg.d_model, cfg.moe_ffn_dim
    return {"experts_gate_up": (d, EMBED, 2 * f, MLP), "experts_down": (f, MLP, d, EMBED)}[name]


def expert_adapters(targets: tuple[str, ...]) -> tuple[str, ...]:
    """The expert adapters `targets` ask for, in `EXPERT_ADAPTERS` order."""
    return tuple(n for n, ws in EXPERT_ADAPTERS.items() if all(w in targets for w in ws))


def max_rank(cfg, targets: tuple[str, ...]) -> int:
    """The largest rank every target allows: the smaller of its flat input and output widths."""
    out = []
    for t in targets:
        i, _, o, _ = weight_dims(cfg, t)
        if cfg.n_experts and t not in ATTENTION:  # an expert tensor's
            i, o = (cfg.d_model,), (cfg.moe_ffn_dim,)
        out.append(min(math.prod(i), math.prod(o)))
    return min(out)


def adapter_param_count(cfg, spec: LoraSpec, active: bool = False) -> int:
    """Adapter params of the decoder: r x (in + out) per target weight per layer; on a
    mixture-of-experts model's sparse layers, E x r x (in + out) per expert adapter
    (`active`: the k experts a token uses)."""
    attn, mlp = [t for t in spec.targets if t in ATTENTION], [t for t in spec.targets if t not in ATTENTION]

    def dense(ts):
        return sum(spec.rank * (math.prod(weight_dims(cfg, t)[0]) + math.prod(weight_dims(cfg, t)[2])) for t in ts)

    if not cfg.n_experts:
        return cfg.n_layers * (dense(attn) + dense(mlp))
    per_expert = sum(
        spec.rank * (i + o) for i, _, o, _ in map(lambda n: expert_adapter_dims(cfg, n), expert_adapters(spec.targets))
    )
    experts = cfg.experts_per_token if active else cfg.n_experts
    sparse = sum(cfg.sparse_layers())
    return cfg.n_layers * dense(attn) + sparse * experts * per_expert


def _a_init(fan_in: int):
    return lambda key, shape, dtype=jnp.float32: a_init(key, shape, fan_in, dtype)  # PEFT's


def keep_mask(key, rate: float, shape) -> jax.Array:
    """Dropout's keep mask (bool, `shape`): each element kept with probability 1 - `rate`."""
    return jax.random.bernoulli(key, 1.0 - rate, shape)


def dropped(x, key, rate: float):
    """Inverted dropout of `x` (kept elements scaled by 1 / (1 - rate)); `x` itself without a
    key or at rate 0."""
    if key is None or not rate:
        return x
    keep = keep_mask(key, rate, x.shape)
    return jnp.where(keep, x / jnp.asarray(1.0 - rate, x.dtype), jnp.zeros((), x.dtype))


def layer_keys(key, n_layers: int):
    """The dropout keys of layers 0..n-1, `fold_in(key, l)` stacked (None without a key)."""
    if key is None:
        return None
    return jax.vmap(lambda i: jax.random.fold_in(key, i))(jnp.arange(n_layers))


class Adapter(nnx.Module):
    """One weight's adapter: `lora_a` (in..., r) and `lora_b` (r, out...), zero (step 0 is
    the base) unless `spec.init_weights` is False."""

    def __init__(self, in_shape, in_names, out_shape, out_names, spec: LoraSpec, rngs: nnx.Rngs):
        a_init = nnx.with_partitioning(_a_init(math.prod(in_shape)), tuple(in_names) + (LORA_RANK,))
        b_fn = nnx.initializers.zeros if spec.init_weights else _a_init(spec.rank)
        b_init = nnx.with_partitioning(b_fn, (LORA_RANK,) + tuple(out_names))
        self.lora_a = nnx.Param(a_init(rngs.params(), tuple(in_shape) + (spec.rank,)))
        self.lora_b = nnx.Param(b_init(None if spec.init_weights else rngs.params(), (spec.rank,) + tuple(out_shape)))
        self.scale, self.dropout = spec.scale, spec.dropout

    def __call__(self, x2, key=None):
        """x2 (N, in) -> scale * (dropout(x2) A) B, (N, out): two thin dots, no weight-shaped
        product; dropout only with a `key`."""
        a, b = self.lora_a[...], self.lora_b[...]
        r = b.shape[0]
        xa = matmul(dropped(x2, key, self.dropout), a.reshape(-1, r))
        return matmul(xa, b.reshape(r, -1)) * jnp.asarray(self.scale, xa.dtype)


class ExpertAdapter(nnx.Module):
    """One expert tensor's adapters, one per expert: `lora_a` (E, in, r), `lora_b` (E, r, out),
    sharded on the expert dim as the experts are; B zero unless `spec.init_weights` is False
    (then drawn as PEFT's nn.Linear(r * E, out) is)."""

    def __init__(self, n_experts: int, d_in: int, in_name: str, d_out: int, out_name: str, spec: LoraSpec, rngs):
        a_init = nnx.with_partitioning(_a_init(d_in), (EXPERT, in_name, LORA_RANK))
        b_fn = nnx.initializers.zeros if spec.init_weights else _a_init(spec.rank * n_experts)
        b_init = nnx.with_partitioning(b_fn, (EXPERT, LORA_RANK, out_name))
        self.lora_a = nnx.Param(a_init(rngs.params(), (n_experts, d_in, spec.rank)))
        self.lora_b = nnx.Param(b_init(None if spec.init_weights else rngs.params(), (n_experts, spec.rank, d_out)))
        self.scale = spec.scale


def attach(block, cfg, spec: LoraSpec, rngs: nnx.Rngs) -> None:
    """Give `block`'s attention and MLP their adapters (`module.lora`, keyed by weight name);
    a sparse block's experts theirs (`block.moe.lora`, keyed by `EXPERT_ADAPTERS`)."""
    # a mixture-of-experts model's MLP targets are its experts' (PEFT's target_parameters);
    # its dense MLP layers (`mlp_only_layers`) keep no adapters, as PEFT leaves them then
    mlp = None if cfg.n_experts else getattr(block, "mlp", None)
    for module, names in ((block.attn, ATTENTION), (mlp, WEIGHTS[4:])):
        chosen = [n for n in names if n in spec.targets and module is not None]
        if chosen:
            module.lora = nnx.Dict(
                {n: Adapter(*weight_dims(cfg, n), spec, rngs) for n in chosen}  # type: ignore[misc]
            )
    moe, chosen = getattr(block, "moe", None), expert_adapters(spec.targets)
    if moe is not None and chosen:
        moe.lora = nnx.Dict(
            {n: ExpertAdapter(cfg.n_experts, *expert_adapter_dims(cfg, n), spec, rngs) for n in chosen}  # type: ignore[misc]
        )


def delta(module, name: str, x2, key=None):
    """The adapter's term for weight `name` of `module` on rows `x2`, or None without one;
    `key`: the layer's dropout key (the weight's is `fold_in(key, WEIGHTS.index(name))`)."""
    adapters = getattr(module, "lora", None)
    if adapters is None or name not in adapters:
        return None
    return adapters[name](x2, None if key is None else jax.random.fold_in(key, WEIGHTS.index(name)))


def is_adapter(path) -> bool:
    """Is the param at `path` (a key path or "a/b/c" string) an adapter leaf?"""
    s = path if isinstance(path, str) else path_str(path)
    return s.rsplit("/", 1)[-1] in ADAPTER_LEAVES


def adapter_mask(params):
    """A bool tree matching `params`: True on adapter leaves (what LoRA trains)."""
    return jax.tree_util.tree_map_with_path(lambda p, _: is_adapter(p), params)


def split(params) -> tuple[dict, dict]:
    """(base, adapters): nested dicts holding the frozen leaves and the adapter leaves."""
    base: dict = {}
    adapters: dict = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params)[0]:
        keys = [getattr(k, "key", getattr(k, "idx", None)) for k in path]
        node = adapters if is_adapter(path) else base
        for k in keys[:-1]:
            node = node.setdefault(k, {})
        node[keys[-1]] = leaf
    return base, adapters


def join(base: dict, adapters: dict) -> dict:
    """`split`'s inverse: one nested dict."""
    out = jax.tree.map(lambda x: x, base)

    def merge(dst, src):
        for k, v in src.items():
            if isinstance(v, dict):
                merge(dst.setdefault(k, {}), v)
            else:
                dst[k] = v

    merge(out, adapters)
    return out
