"""Hugging Face PEFT LoRA adapters in and out, and the merged weights.

    adapters = read_peft("ft-adapter", model_cfg, spec)       # lora.init_from=peft:DIR
    write_peft("out/adapter", adapters, model_cfg, spec)      # scripts/export.py RUN --peft OUT
    merged = merge(base_params, adapters, spec)               # W + scale * A B, for --hf OUT

A PEFT directory holds `adapter_config.json` (r, lora_alpha, use_rslora, target_modules)
and `adapter_model.safetensors` with one pair per targeted Linear and layer,
`base_model.model.model.layers.N.self_attn.q_proj.lora_A.weight` (r, in) and
`...lora_B.weight` (out, r), in torch's (out, in) orientation. The decoder's adapters are
`lora_a` (in..., r) = A.T and `lora_b` (r, out...) = B.T, reshaped to the weight's
head dims and stacked over layers when the layers are scanned (a mixture-of-experts
model's by segment, `fsdp_jax.app.models.stack.segment_layers`: its attention adapters carry the
same PEFT names). Adapters are numpy trees here (`fsdp_jax.app.models.lora.split`'s nested dicts).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import jax
import numpy as np

from fsdp_jax.app.hf import peft_experts
from fsdp_jax.app.models import families, lora
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.stack import segment_layers
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from fsdp_jax.errors import CheckpointError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"


def ours_to_peft() -> dict[str, str]:
    """The decoder's weight -> PEFT's target_modules name (wq: q_proj, ...)."""
    return {v: k for k, v in lora.peft_targets().items()}


# where each kind of adapter sits: (our module, its adapters attribute); a shared expert's
# weights are the MoE's `shared_*` params. PEFT's module of each: `families.peft_modules`
SITES = {
    "attn": ("attn", "lora"),
    "mlp": ("mlp", "lora"),
    "shared": ("moe", "shared_lora"),
    "router": ("moe", "router_lora"),
}
SHARED_PARAMS = {
    "w_gate": "shared_gate",
    "w_up": "shared_up",
    "w_down": "shared_down",
    "w_shared_gate": "shared_weight",
}


def peft_key(cfg: DecoderConfig, layer: int, weight: str, half: str, site: str | None = None) -> str:
    """PEFT's tensor name of `weight`'s lora_A / lora_B (`half` "A" or "B") in `layer` of
    model `cfg`, at `site` (`SITES`; default: attention or the dense MLP by the weight)."""
    site = site or ("attn" if weight in lora.attention_weights(cfg) else "mlp")
    module = families.peft_modules(cfg)[f"{site}/{weight}"]
    return f"base_model.model.model.layers.{layer}.{module}.lora_{half}.weight"


def layer_nodes(cfg: DecoderConfig) -> list[tuple[tuple, list[int]]]:
    """[(key path of a block's params, the layer of each entry)]: a path whose block is
    stacked (scanned layers) holds one entry per layer listed, else the one layer."""
    return [(path, layers) for path, layers, _ in layer_rows(cfg)]


def layer_rows(cfg: DecoderConfig) -> list[tuple[tuple, list[int], bool]]:
    """`layer_nodes` with each block's kind: sparse (the experts) or dense."""
    if cfg.n_experts:
        rows = segment_layers(cfg)
    elif cfg.scan_layers:
        rows = [("blocks", list(range(cfg.n_layers)), False)]
    else:
        rows = [(f"blocks/{i}", [i], False) for i in range(cfg.n_layers)]
    return [(tuple(int(k) if k.isdigit() else k for k in p.split("/")), layers, sp) for p, layers, sp in rows]


def sites(cfg: DecoderConfig, spec: lora.LoraSpec, sparse: bool) -> list[tuple[str, str]]:
    """[(weight, site)] of the plain (per-weight) adapters of a sparse or dense block."""
    mods, _ = lora.adapted(cfg, spec)
    attn = lora.attention_weights(cfg)
    out = [(w, "attn") for w in mods if w in attn]
    if sparse and lora.shared_width(cfg):
        out += [(w, "shared") for w in mods if w not in attn and w != lora.ROUTER]
    elif not sparse:
        out += [(w, "mlp") for w in mods if w in lora.MLP_WEIGHTS]
    return out + ([(lora.ROUTER, "router")] if sparse and lora.ROUTER in mods else [])


def _at(tree: dict, path: tuple, make: bool = False) -> dict:
    for k in path:
        tree = tree.setdefault(k, {}) if make else tree[k]
    return tree


def _pairs(adapters: dict, cfg: DecoderConfig, spec: lora.LoraSpec):
    """[(layer, weight or expert adapter, site ("experts" for those), lora_a, lora_b)] of a
    nested adapters tree, one per layer and adapter, in layer order."""
    out = []
    for path, layers, sparse in layer_rows(cfg):
        block = _at(adapters, path)
        found = [(w, site, block[SITES[site][0]][SITES[site][1]][w]) for w, site in sites(cfg, spec, sparse)]
        found += [(p, "experts", block["moe"]["lora"][p]) for p in (_expert_parts(cfg, spec) if sparse else ())]
        for w, site, node in found:
            a, b = np.asarray(node["lora_a"]), np.asarray(node["lora_b"])
            for g, layer in enumerate(layers):
                out.append((layer, w, site, *((a[g], b[g]) if cfg.scan_layers else (a, b))))
    return sorted(out, key=lambda t: t[0])


def to_peft(adapters: dict, cfg: DecoderConfig, spec: lora.LoraSpec) -> dict[str, np.ndarray]:
    """{PEFT tensor name: (r, in) / (out, r) array} of a nested adapters tree (an expert
    adapter's: `peft_experts`)."""
    out, parts = {}, _expert_parts(cfg, spec)
    for i, w, site, a, b in _pairs(adapters, cfg, spec):
        if site == "experts":
            for half, x in zip("AB", peft_experts.to_peft(a, b)):
                out[peft_experts.peft_key(i, w, half, parts)] = x
            continue
        out[peft_key(cfg, i, w, "A", site)] = np.ascontiguousarray(a.reshape(-1, spec.rank).T)
        out[peft_key(cfg, i, w, "B", site)] = np.ascontiguousarray(b.reshape(spec.rank, -1).T)
    return dict(sorted(out.items()))


def _expert_parts(cfg: DecoderConfig, spec: lora.LoraSpec) -> tuple[str, ...]:
    return lora.adapted(cfg, spec)[1]


def from_peft(tensors, cfg: DecoderConfig, spec: lora.LoraSpec, where: str = "adapter") -> dict:
    """A nested adapters tree (the decoder's layout) from `tensors` (name -> array, or a
    reader `name -> array`). CheckpointError naming a missing tensor or a wrong shape."""
    read = tensors if callable(tensors) else tensors.__getitem__
    r = spec.rank

    def pair(keys, want):
        got = {}
        for half in "AB":
            try:
                x = np.asarray(read(keys[half]), np.float32)
            except KeyError:
                raise CheckpointError(f"{where}: no tensor {keys[half]} (an adapter for another model?)") from None
            if x.shape != want[half]:
                raise CheckpointError(
                    f"{where}: {keys[half]} has shape {x.shape}, this model and lora.rank={r} need {want[half]} "
                    "(an adapter for another base or rank)"
                )
            got[half] = x
        return got

    per_layer: list[dict] = [{} for _ in range(cfg.n_layers)]
    parts = _expert_parts(cfg, spec)
    for _, layers, sparse in layer_rows(cfg):
        for i in layers:
            for w, site in sites(cfg, spec, sparse):
                ins, _, outs, _ = lora.weight_dims(cfg, w, site == "shared")
                want = {"A": (r, math.prod(ins)), "B": (math.prod(outs), r)}
                got = pair({h: peft_key(cfg, i, w, h, site) for h in "AB"}, want)
                module, attr = SITES[site]
                node = per_layer[i].setdefault(module, {}).setdefault(attr, {})
                node[w] = {"lora_a": got["A"].T.reshape(*ins, r), "lora_b": got["B"].T.reshape(r, *outs)}
            for part in parts if sparse else ():
                got = pair(
                    {h: peft_experts.peft_key(i, part, h, parts) for h in "AB"},
                    peft_experts.shapes(cfg, part, spec.expert(part).rank),
                )
                a, b = peft_experts.from_peft(got["A"], got["B"], cfg.n_experts)
                per_layer[i].setdefault("moe", {}).setdefault("lora", {})[part] = {"lora_a": a, "lora_b": b}
    out: dict = {}
    for path, layers in layer_nodes(cfg):
        rows = [per_layer[i] for i in layers]
        node = rows[0] if not cfg.scan_layers else jax.tree.map(lambda *xs: np.stack(xs), *rows)
        _at(out, path[:-1], make=True)[path[-1]] = node
    return out


def read_config(directory: Path) -> dict:
    """adapter_config.json of a PEFT directory; CheckpointError (one line) when missing or bad."""
    path = directory / CONFIG
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"peft:{directory}: no {CONFIG} (not a PEFT adapter directory)") from None
    except (OSError, ValueError) as e:
        raise CheckpointError(f"peft:{directory}: {CONFIG} does not parse ({e})") from None
    if not isinstance(raw, dict) or raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"peft:{directory}: {CONFIG} is not a LoRA adapter")
    return raw


def check_matches(raw: dict, spec: lora.LoraSpec, where: str, cfg: DecoderConfig) -> None:
    """The adapter's r, alpha, rsLoRA and what it adapts on model `cfg` (its target_modules
    and target_parameters, as PEFT applies them) against the run's `lora:` section."""
    modules = raw.get("target_modules") or []
    peft = lora.peft_targets()
    modules = lora.TARGETS if modules == "all-linear" else tuple(peft.get(t, t) for t in modules)
    by_param = parameter_targets(cfg)  # {PEFT's "<module>.weight": our weight}
    named = [full_parameter_name(p, by_param) for p in raw.get("target_parameters") or []]  # all-linear's "gate.weight"
    try:
        parts = peft_experts.parts_of([p for p in named if p not in by_param])
        gate_up = peft_experts.pattern_rank(raw) if "experts_gate_up" in parts else 0
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    # those PEFT reaches only as parameters: a target_modules name of theirs means the experts there
    as_modules = sorted(_peft_name(t) for t in set(modules) & set(by_param.values()))
    if as_modules:
        raise CheckpointError(
            f"{where}: target_modules {' '.join(as_modules)} (or all-linear) mean the routed experts on {cfg.family} "
            f"in peft 0.21; this model's MLP adapters are target_parameters {' '.join(sorted(by_param))}"
        )
    params = {by_param[p] for p in named if p in by_param}
    known = tuple(t for t in lora.NAMED if (t in modules and t not in by_param.values()) or t in params)
    theirs = lora.adapted(cfg, lora.LoraSpec(spec.rank, spec.alpha, known, experts=parts))
    ours = lora.adapted(cfg, spec)
    checks = (
        ("lora.rank", spec.rank, raw.get("r")),
        ("lora.alpha", spec.alpha, raw.get("lora_alpha")),
        ("lora.rslora", spec.rslora, bool(raw.get("use_rslora", False))),
        ("lora.targets", set(ours[0]), set(theirs[0]) | set(modules) - set(known)),
        ("lora.target_parameters", set(ours[1]), set(theirs[1])),
        ("lora.gate_up_rank", spec.gate_up_rank if "experts_gate_up" in ours[1] else 0, gate_up),
    )
    for key, mine, other in checks:
        if mine != other:
            shown = " ".join(sorted(_peft_name(t) for t in other)) if isinstance(other, set) else other
            raise CheckpointError(
                f"{where}: the adapter has {key.split('.')[1]}={shown or 'none'}, the run's {key} differs"
            )
    if (
        raw.get("use_dora")
        or raw.get("lora_bias")
        or (not gate_up and (raw.get("rank_pattern") or raw.get("alpha_pattern")))
    ):
        raise CheckpointError(
            f"{where}: DoRA, LoRA biases and rank/alpha patterns off the experts' gate_up_proj are not supported"
        )


def parameter_targets(cfg: DecoderConfig) -> dict[str, str]:
    """{PEFT target_parameters name ("mlp.shared_experts.gate_proj.weight"): the decoder's weight}
    of the weights model `cfg`'s family has PEFT reach as parameters (`families.peft_parameters`)."""
    names = families.peft_modules(cfg)
    return {f"{names[p]}.weight": p.split("/")[1] for p in families.peft_parameters(cfg) if p in names}


def full_parameter_name(p: str, by_param: dict[str, str]) -> str:
    """A target_parameters entry as `parameter_targets` names it (PEFT matches by suffix: "gate.weight")."""
    return next((k for k in by_param if k == p or k.endswith("." + p)), p)


def _peft_name(t: str) -> str:
    return ours_to_peft().get(t) or peft_experts.PEFT_PARAMETERS.get(t, t)


def read_peft(directory, cfg: DecoderConfig, spec: lora.LoraSpec) -> dict:
    """The adapters of PEFT directory `directory` as a nested numpy tree (f32), checked
    against `spec` and the model's shapes; CheckpointError (one line) on any mismatch."""
    directory = Path(directory)
    where = f"lora.init_from=peft:{directory}"
    check_matches(read_config(directory), spec, where, cfg)
    if not (directory / WEIGHTS).is_file():
        raise CheckpointError(f"{where}: no {WEIGHTS}")
    f, seen = SafetensorsFile(directory / WEIGHTS), set()

    def read(name):
        if name not in f.tensors:
            raise KeyError(name)
        seen.add(name)
        return f.read(name, dtype=np.float32)

    out = from_peft(read, cfg, spec, where)
    extra = sorted(set(f.tensors) - seen)
    if extra:  # e.g. modules this model's LoRA does not adapt: refused, not dropped
        raise CheckpointError(f"{where}: {len(extra)} tensors this model's adapters do not hold, e.g. {extra[0]}")
    return out


def adapter_config(spec: lora.LoraSpec, base: str | None, cfg: DecoderConfig) -> dict:
    """The adapter_config.json PEFT's `PeftModel.from_pretrained` needs for `spec` (on model
    `cfg`: a mixture of experts adapts its experts through `target_parameters`, its dense
    MLP names only where it has dense layers)."""
    modules, parts = lora.adapted(cfg, spec)
    params = [peft_experts.PEFT_PARAMETERS[p] for p in parts]
    by_param = families.peft_parameters(cfg)  # those adapted on this model, as target_parameters
    present = {f"{site}/{w}" for _, _, sparse in layer_rows(cfg) for w, site in sites(cfg, spec, sparse)}
    params += sorted(f"{families.peft_modules(cfg)[p]}.weight" for p in by_param if p in present)
    modules = tuple(w for w in modules if not any(p.endswith("/" + w) for p in by_param))
    out = {
        "base_model_name_or_path": base,
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": spec.rank,
        "target_modules": sorted(ours_to_peft()[t] for t in modules) or None,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": spec.rslora,
    }
    if params:
        out["target_parameters"] = params
    return {**out, **peft_experts.patterns(spec, parts)}


def write_peft(out, adapters: dict, cfg: DecoderConfig, spec: lora.LoraSpec, base: str | None = None) -> dict:
    """Write `adapters` as PEFT directory `out` (must not exist, or be empty), through a
    temporary directory renamed at the end. Returns {"tensors", "bytes", "path"}."""
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"--peft {out}: already exists; choose a new directory")
    if not out.absolute().parent.is_dir():
        raise CheckpointError(f"--peft {out}: its parent directory does not exist")
    tensors = to_peft(adapters, cfg, spec)
    tmp = out.absolute().parent / f".{out.name}.tmp.{os.getpid()}"
    try:
        tmp.mkdir()
        entries = [(k, v.shape, v.dtype) for k, v in tensors.items()]
        write_safetensors(tmp / WEIGHTS, entries, tensors.__getitem__)
        (tmp / CONFIG).write_text(json.dumps(adapter_config(spec, base, cfg), indent=2, sort_keys=True) + "\n")
        if out.exists():
            out.rmdir()
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return {"tensors": len(tensors), "bytes": sum(x.nbytes for x in tensors.values()), "path": str(out)}


def _copy_dicts(tree):
    return {k: _copy_dicts(v) for k, v in tree.items()} if isinstance(tree, dict) else tree


def merged_weight(weight: np.ndarray, a: np.ndarray, b: np.ndarray, spec: lora.LoraSpec) -> np.ndarray:
    """One layer's W + scale * A B (computed in f32), in W's dtype and shape."""
    r = spec.rank
    delta = (a.reshape(-1, r).astype(np.float32) @ b.reshape(r, -1).astype(np.float32)) * np.float32(spec.scale)
    return (weight.astype(np.float32) + delta.reshape(weight.shape)).astype(weight.dtype)


def adapter_of(path: str, cfg: DecoderConfig, spec: lora.LoraSpec) -> tuple[str, str] | None:
    """(the adapters attribute, the adapter's key) adapting the base param at `path`
    ("segments/0/layers/1/moe/w_gate"), or None when LoRA leaves it as it is."""
    *_, module, leaf = [""] + path.split("/")
    mods, parts = lora.adapted(cfg, spec)
    if module in ("attn", "mlp") and leaf in mods and (module == "attn" or lora.linear_mlps(cfg)):
        return "lora", leaf
    if module != "moe":
        return None
    if leaf == lora.ROUTER:  # DeepSeek-V3's router (PEFT's mlp.gate.weight)
        return ("router_lora", leaf) if leaf in mods else None
    if leaf in lora.MLP_WEIGHTS + ("w_gate_up",):  # an expert tensor: its share of the experts' adapter
        part = peft_experts.part_of(leaf)
        return ("lora", part) if part in parts else None
    shared = {v: k for k, v in SHARED_PARAMS.items()}.get(leaf)
    return ("shared_lora", shared) if shared in mods else None


def merged_leaf(path: str, leaf: np.ndarray, adapters: dict, cfg: DecoderConfig, spec: lora.LoraSpec):
    """The base param at `path` (`leaf`, stacked over layers when they are scanned) with its
    adapter merged (`adapter_of`); `leaf` itself when LoRA leaves it as it is."""
    which = adapter_of(path, cfg, spec)
    if which is None:
        return leaf
    keys = [int(k) if k.isdigit() else k for k in path.split("/")]
    pair = _at(adapters, tuple(keys[:-1]))[which[0]][which[1]]
    a, b, name = np.asarray(pair["lora_a"]), np.asarray(pair["lora_b"]), keys[-1]
    expert = which[1] in lora.EXPERT_ADAPTERS

    def one(w, a, b):
        return (
            peft_experts.merged_weight(name, w, a, b, spec.expert(which[1])) if expert else merged_weight(w, a, b, spec)
        )

    return np.stack([one(leaf[i], a[i], b[i]) for i in range(leaf.shape[0])]) if cfg.scan_layers else one(leaf, a, b)


def merge(base: dict, adapters: dict, cfg: DecoderConfig, spec: lora.LoraSpec) -> dict:
    """`base` (nested numpy tree of the decoder's params) with each target weight replaced by
    W + scale * A B in W's dtype; every other tensor is `base`'s own array, untouched."""
    out = _copy_dicts(base)
    for path, leaf in _flat(out):
        parent = _at(out, tuple(int(k) if k.isdigit() else k for k in path.split("/")[:-1]))
        parent[path.split("/")[-1]] = merged_leaf(path, leaf, adapters, cfg, spec)
    return out


def _flat(tree: dict, prefix: str = ""):
    for k, v in list(tree.items()):
        p = f"{prefix}{k}"
        yield from _flat(v, p + "/") if isinstance(v, dict) else [(p, v)]
