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
section resolves to it. Adapters are created after every other param of a block, so a
model with adapters draws its base params exactly as one without.

Dropout (`LoraSpec.dropout`, PEFT's `lora_dropout`) acts on the adapter's input only, and
only when the decoder is given a dropout key (the train step's; eval, verify and logits
run without). Its masks come from the key alone: the key of layer `l` is
`fold_in(key, l)` (`layer_keys`), of weight `w` in it `fold_in(that, WEIGHTS.index(w))`,
and the mask keeps each element of the input rows with probability 1 - p (`keep_mask`),
so they are the same on one device and on N, under every strategy (`models/lora_dropout.py`).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from flax import nnx

from fsdp_jax.app.models.families import registry  # the records, not the family modules
from fsdp_jax.app.models.lora_dropout import dropped
from fsdp_jax.model.lora import a_init
from fsdp_jax.quant.weight import QuantSpec
from fsdp_jax.sharding.axes import EMBED, EXPERT, HEADS, KV, KV_HEADS, LORA_RANK, MLP
from fsdp_jax.sharding.leaf_sharding import path_str
from fsdp_jax.sharding.precision import matmul

ATTENTION = ("wq", "wk", "wv", "wo")
MLP_WEIGHTS = ("w_gate", "w_up", "w_down")
SHARED_GATE = "w_shared_gate"  # a shared expert's (D, 1) sigmoid gate
WEIGHTS = ATTENTION + MLP_WEIGHTS  # a dense decoder's projections
LATENT = ("wq_a", "wq_b", "wkv_a", "wkv_b")  # latent attention's own (`LatentAttention.lora_dims`)
# every name `targets` takes, in this order (dropout keys index it: new names go last)
TARGETS = WEIGHTS + (SHARED_GATE,) + LATENT
# DeepSeek-V3's router (D, E), adapted only when named (`gate`: PEFT's target_parameters mlp.gate.weight,
# which peft 0.21's all-linear adds there); every name `targets` takes (dropout keys index it)
ROUTER = "router"
NAMED = TARGETS + (ROUTER,)
ADAPTER_LEAVES = ("lora_a", "lora_b")


def peft_targets() -> dict[str, str]:
    """PEFT's target_modules names -> the decoder's weights (q_proj: wq, ...), as the
    registered families name them (`fsdp_jax.app.models.families.peft_targets`)."""
    return registry.peft_targets()


@dataclasses.dataclass(frozen=True)
class LoraSpec:
    """rank r, alpha, rslora (scale alpha / sqrt(r), else alpha / r), and the target weights (the
    decoder's names, `WEIGHTS` order). `init_weights`: PEFT's `init_lora_weights`; True (its default)
    starts B at zero, so step 0 is the base; False draws B as torch's nn.Linear(r, out) does, like A
    (PEFT's choice for tests: an adapter that is not a no-op; `verify` uses it, `app.cli.verify`)."""

    rank: int
    alpha: float
    targets: tuple[str, ...] = WEIGHTS
    rslora: bool = False
    dropout: float = 0.0  # on the adapters' input, in training only
    init_weights: bool = True
    # adapted expert tensors (`EXPERT_ADAPTERS`, PEFT's target_parameters); None: `spec_experts`
    experts: tuple[str, ...] | None = None
    # QLoRA: frozen targets stored quantised (`fsdp_jax.quant`), dequantised to `quant_dtype` per layer
    base_quant: QuantSpec | None = None
    quant_dtype: str = "float32"
    gate_up_rank: int = 0  # experts_gate_up's rank (PEFT's rank_pattern; its alpha scaled alike); 0: rank

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)

    def expert(self, name: str) -> LoraSpec:
        """Expert adapter `name`'s spec: experts_gate_up at `gate_up_rank`, alpha x gate_up_rank / rank."""
        g = self.gate_up_rank if name == "experts_gate_up" else 0
        return dataclasses.replace(self, rank=g, alpha=self.alpha * g / self.rank) if g else self


def resolve_targets(spec: str) -> tuple[str, ...]:
    """`"all-linear"` or names (PEFT's `q_proj ...` or the decoder's `wq ...`, separated by
    spaces or commas) -> the decoder's weight names in `WEIGHTS` order. ValueError naming the
    unknown names and listing the ones that exist."""
    names = [n for n in spec.replace(",", " ").split() if n]
    if names == ["all-linear"]:
        return TARGETS
    peft = peft_targets()
    ours = {peft.get(n, n) for n in names}
    unknown = [n for n in names if peft.get(n, n) not in NAMED]
    if unknown or not names:
        raise ValueError(
            f"{' '.join(unknown) or repr(spec)} matches no weight; the targets are all-linear, "
            f"{' '.join(peft)} (or {' '.join(NAMED)})"
        )
    return tuple(w for w in NAMED if w in ours)


# PEFT's target_parameters names of the experts' fused tensors -> the expert adapters
PEFT_PARAMETERS = {"mlp.experts.gate_up_proj": "experts_gate_up", "mlp.experts.down_proj": "experts_down"}


def resolve_experts(spec: str) -> tuple[str, ...] | None:
    """`lora.target_parameters`: "auto" (None: the experts the MLP targets name), "none" (()), or PEFT's
    names (`mlp.experts.gate_up_proj mlp.experts.down_proj`, or last parts); ValueError naming an unknown one."""
    names = [n for n in spec.replace(",", " ").split() if n]
    if names == ["auto"]:
        return None
    if names == ["none"]:
        return ()
    out = []
    for n in names:
        ours = next((v for k, v in PEFT_PARAMETERS.items() if n in (k, v) or k.endswith("." + n)), None)
        if ours is None:
            raise ValueError(
                f"{n} is no expert tensor; the target_parameters are auto, none, {' '.join(PEFT_PARAMETERS)}"
            )
        out.append(ours)
    return tuple(n for n in EXPERT_ADAPTERS if n in out)


def spec_from_config(section) -> LoraSpec | None:
    """The run config's `lora:` section as a `LoraSpec`; None for rank 0 (no LoRA)."""
    if not section.rank:
        return None
    experts = resolve_experts(section.target_parameters)
    targets = resolve_targets(section.targets)
    quant = (
        None
        if section.base_quant == "none"
        else QuantSpec(section.base_quant, section.quant_block, section.double_quant)
    )
    return LoraSpec(
        section.rank,
        section.alpha,
        targets,
        section.rslora,
        section.dropout,
        experts=experts,
        base_quant=quant,
        gate_up_rank=section.gate_up_rank,
    )


def attention_weights(cfg) -> tuple[str, ...]:
    """The attention projections adapters may go on: a family attention part's own
    (`lora_dims`: latent attention's), else `ATTENTION`."""
    own = getattr(registry.block_parts(cfg).attention, "lora_dims", None)
    return ATTENTION if own is None else tuple(t for t in TARGETS if t in own(cfg))


def weight_dims(cfg, name: str, shared: bool = False):
    """(input shape, input names, output shape, output names) of the decoder's weight `name`
    (`shared`: the shared expert's, of width `shared_width`; an attention part's own weights by
    its `lora_dims`)."""
    own = getattr(registry.block_parts(cfg).attention, "lora_dims", None)
    if own is not None and name in own(cfg):
        return own(cfg)[name]
    d, h, kvh, dh = cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    f = shared_width(cfg) if shared else cfg.ffn_dim
    return {
        "wq": ((d,), (EMBED,), (h, dh), (HEADS, KV)),
        "wk": ((d,), (EMBED,), (kvh, dh), (KV_HEADS, KV)),
        "wv": ((d,), (EMBED,), (kvh, dh), (KV_HEADS, KV)),
        "wo": ((h, dh), (HEADS, KV), (d,), (EMBED,)),
        "w_gate": ((d,), (EMBED,), (f,), (MLP,)),
        "w_up": ((d,), (EMBED,), (f,), (MLP,)),
        "w_down": ((f,), (MLP,), (d,), (EMBED,)),
        "w_shared_gate": ((d,), (EMBED,), (1,), (None,)),
        ROUTER: ((d,), (EMBED,), (cfg.n_experts,), (None,)),
    }[name]


# the experts' adapters, as PEFT puts them on transformers' fused expert tensors (target_parameters
# `mlp.experts.gate_up_proj` (E, 2F, D), `down_proj` (E, D, F)): gate and up share one (gate first)
EXPERT_ADAPTERS: dict[str, tuple[str, ...]] = {"experts_gate_up": ("w_gate", "w_up"), "experts_down": ("w_down",)}


def shared_width(cfg) -> int:
    """The shared expert's width: Qwen2-MoE's gated one, or DeepSeek-V3's shared experts (0: none)."""
    return cfg.shared_expert_ffn_dim or cfg.shared_experts_ffn_dim


def linear_mlps(cfg) -> bool:
    """Do the MLP targets (gate_proj up_proj down_proj) adapt the model's plain MLPs, as
    PEFT's `target_modules` do: a dense model's; on a mixture of experts, only where they are
    nn.Linear modules PEFT wraps, a shared expert's (Qwen2-MoE: its dense layers and its shared expert),
    or reaches as target_parameters (DeepSeek-V3's, `families.peft_parameters`). Qwen3-MoE's dense
    layers keep none: peft 0.21 maps their target_modules names to the fused experts."""
    return not cfg.n_experts or bool(cfg.shared_expert_ffn_dim) or bool(registry.peft_parameters(cfg))


def spec_experts(spec: LoraSpec) -> tuple[str, ...]:
    """The expert adapters `spec` adapts (on a model with routed experts): its `experts`, or
    by default those its MLP targets name (gate_proj + up_proj: gate_up_proj; down_proj)."""
    return expert_adapters(spec.targets) if spec.experts is None else spec.experts


def own_experts(cfg) -> bool | str:
    """Are `cfg`'s experts a family's sparse MLP part (`BlockParts.moe`)? "named" where the part takes
    adapters (`expert_lora`: gpt-oss's) only as `lora.target_parameters` names them; True: none."""
    part = (fam := registry.of_config(cfg)) is not None and fam.parts.moe
    return bool(part) and ("named" if getattr(part, "expert_lora", False) else True)


def adapted(cfg, spec: LoraSpec) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(the targets that adapt something on model `cfg`, `TARGETS` order; its expert
    adapters): PEFT's target_modules and target_parameters for it."""
    attn = attention_weights(cfg)
    mods = [t for t in spec.targets if t in attn or (t in MLP_WEIGHTS and linear_mlps(cfg))]
    mods += [SHARED_GATE] if SHARED_GATE in spec.targets and cfg.shared_expert_ffn_dim else []
    mods += [ROUTER] if ROUTER in spec.targets and f"router/{ROUTER}" in registry.peft_parameters(cfg) else []
    own = own_experts(cfg) if cfg.n_experts else True
    experts = (spec.experts or ()) if own == "named" else () if own else spec_experts(spec)
    return tuple(t for t in NAMED if t in mods), experts


def expert_adapter_dims(cfg, name: str) -> tuple[int, str, int, str]:
    """(in width, in name, out width, out name) of expert adapter `name` (`EXPERT_ADAPTERS`)."""
    d, f = cfg.d_model, cfg.moe_ffn_dim
    return {"experts_gate_up": (d, EMBED, 2 * f, MLP), "experts_down": (f, MLP, d, EMBED)}[name]


def expert_adapters(targets: tuple[str, ...]) -> tuple[str, ...]:
    """The expert adapters `targets` ask for, in `EXPERT_ADAPTERS` order."""
    return tuple(n for n, ws in EXPERT_ADAPTERS.items() if all(w in targets for w in ws))


def _matrices(cfg, spec: LoraSpec) -> list[tuple[int, int, int, int, int]]:
    """(flat in width, flat out width, how many, how many a token uses, rank) of each kind of
    adapted matrix: per layer (attention), per dense layer, per shared expert, per expert
    of a sparse layer (a token uses k of those)."""
    mods, experts = adapted(cfg, spec)
    n_sparse = sum(cfg.sparse_layers()) if cfg.n_experts else 0

    def flat(t, shared=False):
        i, _, o, _ = weight_dims(cfg, t, shared)
        return math.prod(i), math.prod(o)

    attn = attention_weights(cfg)
    r = spec.rank
    out = [(*flat(t), cfg.n_layers, cfg.n_layers, r) for t in mods if t in attn]
    out += [(*flat(t), cfg.n_layers - n_sparse, cfg.n_layers - n_sparse, r) for t in mods if t in MLP_WEIGHTS]
    if shared_width(cfg):
        out += [(*flat(t, True), n_sparse, n_sparse, r) for t in mods if t not in attn and t != ROUTER]
    out += [(*flat(ROUTER), n_sparse, n_sparse, r)] if ROUTER in mods else []
    for n in experts:
        i, _, o, _ = expert_adapter_dims(cfg, n)
        out.append((i, o, n_sparse * cfg.n_experts, n_sparse * cfg.experts_per_token, spec.expert(n).rank))
    return [m for m in out if m[2]]


def max_rank(cfg, targets: tuple[str, ...], experts: tuple[str, ...] | None = None) -> int:
    """The largest rank every target allows: its smallest flat width (not the (D, 1) gate's)."""
    sizes = [min(i, o) for i, o, _, _, _ in _matrices(cfg, LoraSpec(1, 1.0, targets, experts=experts)) if o > 1]
    return min(sizes) if sizes else cfg.d_model


def adapter_param_count(cfg, spec: LoraSpec, active: bool = False) -> int:
    """Adapter params of the decoder: r x (in + out) per adapted matrix (per layer; on a
    mixture of experts E per expert adapter of each sparse layer, `active`: the k a token
    uses; one for its shared expert's and its dense layers' projections)."""
    return sum(r * (i + o) * (k if active else n) for i, o, n, k, r in _matrices(cfg, spec))


def _a_init(fan_in: int):
    return lambda key, shape, dtype=jnp.float32: a_init(key, shape, fan_in, dtype)  # PEFT's


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
    a sparse block's experts theirs (`block.moe.lora`, keyed by `EXPERT_ADAPTERS`) and its
    shared expert its (`block.moe.shared_lora`, keyed by weight name)."""
    mods, experts = adapted(cfg, spec)
    moe = getattr(block, "moe", None)
    for module, names, shared in (
        (block.attn, attention_weights(cfg), False),
        (getattr(block, "mlp", None), MLP_WEIGHTS, False),
        (moe if shared_width(cfg) else None, MLP_WEIGHTS + (SHARED_GATE,), True),
    ):
        chosen = [n for n in names if n in mods and module is not None]
        if chosen:
            adapters = nnx.Dict({n: Adapter(*weight_dims(cfg, n, shared), spec, rngs) for n in chosen})  # type: ignore[misc]
            setattr(module, "shared_lora" if shared else "lora", adapters)
    if moe is not None and ROUTER in mods:  # DeepSeek-V3's router: added to its logits (`GroupedMoE`)
        moe.router_lora = nnx.Dict({ROUTER: Adapter(*weight_dims(cfg, ROUTER), spec, rngs)})  # type: ignore[misc]
    if moe is not None and experts:
        moe.lora = nnx.Dict(
            {n: ExpertAdapter(cfg.n_experts, *expert_adapter_dims(cfg, n), spec.expert(n), rngs) for n in experts}  # type: ignore[misc]
        )


def delta(module, name: str, x2, key=None, where: str = "lora"):
    """The adapter's term for weight `name` of `module` on rows `x2`, or None without one;
    `key`: the layer's dropout key (the weight's is `fold_in(key, NAMED.index(name))`);
    `where`: the module's adapters attribute (a shared expert's: "shared_lora")."""
    adapters = getattr(module, where, None)
    if adapters is None or name not in adapters:
        return None
    return adapters[name](x2, None if key is None else jax.random.fold_in(key, NAMED.index(name)))


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
