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
model's by segment, `fsdp_jax.app.models.stack.segment_layers`: its attention adapters carry
the same PEFT names, `model.layers.N.self_attn.*`). Adapters are numpy trees here
(`fsdp_jax.app.models.lora.split`'s nested-dict layout).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np

from fsdp_jax.app.hf import peft_experts as experts
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.config import LlamaConfig
from fsdp_jax.app.models.stack import segment_layers
from fsdp_jax.checkpoint.safetensors_io import SafetensorsFile, write_safetensors
from fsdp_jax.errors import CheckpointError

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
OURS_TO_PEFT = {v: k for k, v in lora_lib.PEFT_TARGETS.items()}


def peft_key(layer: int, weight: str, half: str) -> str:
    """PEFT's tensor name of `weight`'s lora_A / lora_B (`half` "A" or "B") in `layer`."""
    module = "self_attn" if weight in lora_lib.ATTENTION else "mlp"
    return f"base_model.model.model.layers.{layer}.{module}.{OURS_TO_PEFT[weight]}.lora_{half}.weight"


def _module(weight: str) -> str:
    return "attn" if weight in lora_lib.ATTENTION else "mlp"


def layer_nodes(cfg: LlamaConfig) -> list[tuple[tuple, list[int]]]:
    """[(key path of a block's params, the layer of each entry)]: a path whose block is
    stacked (scanned layers) holds one entry per layer listed, else the one layer."""
    return [(path, layers) for path, layers, _ in layer_rows(cfg)]


def layer_rows(cfg: LlamaConfig) -> list[tuple[tuple, list[int], bool]]:
    """`layer_nodes` with each block's kind: sparse (the experts) or dense."""
    if cfg.n_experts:
        rows = segment_layers(cfg)
    elif cfg.scan_layers:
        rows = [("blocks", list(range(cfg.n_layers)), False)]
    else:
        rows = [(f"blocks/{i}", [i], False) for i in range(cfg.n_layers)]
    return [(tuple(int(k) if k.isdigit() else k for k in p.split("/")), layers, sp) for p, layers, sp in rows]


def _has(cfg: LlamaConfig, weight: str) -> bool:
    """Do `cfg`'s blocks hold `weight`'s adapter (a mixture of experts adapts its experts'
    MLP tensors only, `peft_experts`)?"""
    return weight in lora_lib.ATTENTION or not cfg.n_experts


def _at(tree: dict, path: tuple, make: bool = False) -> dict:
    for k in path:
        tree = tree.setdefault(k, {}) if make else tree[k]
    return tree


def _layers(adapters: dict, cfg: LlamaConfig, weight: str) -> dict[int, tuple]:
    """{layer: (lora_a, lora_b)} of `weight` from a nested adapters tree: every layer that
    holds it (`weight` an expert adapter, `EXPERT_ADAPTERS`: the sparse layers)."""
    expert = weight in lora_lib.EXPERT_ADAPTERS
    out: dict[int, tuple] = {}
    for path, layers, sparse in layer_rows(cfg):
        if not (sparse if expert else _has(cfg, weight)):
            continue
        node = _at(adapters, path)["moe" if expert else _module(weight)]["lora"][weight]
        a, b = np.asarray(node["lora_a"]), np.asarray(node["lora_b"])
        for g, layer in enumerate(layers):
            out[layer] = (a[g], b[g]) if cfg.scan_layers else (a, b)
    return dict(sorted(out.items()))


def to_peft(adapters: dict, cfg: LlamaConfig, spec: lora_lib.LoraSpec) -> dict[str, np.ndarray]:
    """{PEFT tensor name: (r, in) / (out, r) array} of a nested adapters tree (an expert
    adapter's: `peft_experts`)."""
    out = {}
    for w in spec.targets:
        for i, (a, b) in _layers(adapters, cfg, w).items():
            out[peft_key(i, w, "A")] = np.ascontiguousarray(a.reshape(-1, spec.rank).T)
            out[peft_key(i, w, "B")] = np.ascontiguousarray(b.reshape(spec.rank, -1).T)
    parts = _expert_parts(cfg, spec)
    for part in parts:
        for i, (a, b) in _layers(adapters, cfg, part).items():
            for half, x in zip("AB", experts.to_peft(a, b)):
                out[experts.peft_key(i, part, half, parts)] = x
    return out


def _expert_parts(cfg: LlamaConfig, spec: lora_lib.LoraSpec) -> tuple[str, ...]:
    return lora_lib.expert_adapters(spec.targets) if cfg.n_experts else ()


def from_peft(tensors, cfg: LlamaConfig, spec: lora_lib.LoraSpec, where: str = "adapter") -> dict:
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
    sparse_of = {i: sp for _, layers, sp in layer_rows(cfg) for i in layers}
    for w in spec.targets:
        ins, _, outs, _ = lora_lib.weight_dims(cfg, w)
        want = {"A": (r, math.prod(ins)), "B": (math.prod(outs), r)}
        for i in range(cfg.n_layers) if _has(cfg, w) else ():
            got = pair({h: peft_key(i, w, h) for h in "AB"}, want)
            node = per_layer[i].setdefault(_module(w), {"lora": {}})["lora"]
            node[w] = {"lora_a": got["A"].T.reshape(*ins, r), "lora_b": got["B"].T.reshape(r, *outs)}
    parts = _expert_parts(cfg, spec)
    for part in parts:
        for i in (i for i in range(cfg.n_layers) if sparse_of[i]):
            got = pair({h: experts.peft_key(i, part, h, parts) for h in "AB"}, experts.shapes(cfg, part, r))
            a, b = experts.from_peft(got["A"], got["B"], cfg.n_experts)
            per_layer[i].setdefault("moe", {"lora": {}})["lora"][part] = {"lora_a": a, "lora_b": b}
    out: dict = {}
    for path, layers in layer_nodes(cfg):
        if not cfg.scan_layers:
            _at(out, path[:-1], make=True)[path[-1]] = per_layer[layers[0]]
            continue
        first = per_layer[layers[0]]
        stacked = {}
        for m, node in first.items():
            pairs = {
                w: {k: np.stack([per_layer[i][m]["lora"][w][k] for i in layers]) for k in v}
                for w, v in node["lora"].items()
            }
            stacked[m] = {"lora": pairs}
        _at(out, path[:-1], make=True)[path[-1]] = stacked
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


def check_matches(raw: dict, spec: lora_lib.LoraSpec, where: str) -> None:
    """The adapter's r, alpha, rsLoRA and targets against the run's `lora:` section."""
    targets = raw.get("target_modules") or []
    targets = lora_lib.WEIGHTS if targets == "all-linear" else tuple(lora_lib.PEFT_TARGETS.get(t, t) for t in targets)
    try:
        targets += experts.targets_of(raw.get("target_parameters"))
    except ValueError as e:
        raise CheckpointError(f"{where}: {e}") from None
    checks = (
        ("lora.rank", spec.rank, raw.get("r")),
        ("lora.alpha", spec.alpha, raw.get("lora_alpha")),
        ("lora.rslora", spec.rslora, bool(raw.get("use_rslora", False))),
        ("lora.targets", set(spec.targets), set(targets)),
    )
    for key, ours, theirs in checks:
        if ours != theirs:
            shown = " ".join(OURS_TO_PEFT.get(t, t) for t in sorted(theirs)) if isinstance(theirs, set) else theirs
            raise CheckpointError(f"{where}: the adapter has {key.split('.')[1]}={shown}, the run's {key} differs")
    if raw.get("use_dora") or raw.get("lora_bias") or raw.get("rank_pattern") or raw.get("alpha_pattern"):
        raise CheckpointError(f"{where}: DoRA, LoRA biases and per-module rank/alpha patterns are not supported")


def read_peft(directory, cfg: LlamaConfig, spec: lora_lib.LoraSpec) -> dict:
    """The adapters of PEFT directory `directory` as a nested numpy tree (f32), checked
    against `spec` and the model's shapes; CheckpointError (one line) on any mismatch."""
    directory = Path(directory)
    where = f"lora.init_from=peft:{directory}"
    check_matches(read_config(directory), spec, where)
    if not (directory / WEIGHTS).is_file():
        raise CheckpointError(f"{where}: no {WEIGHTS}")
    f = SafetensorsFile(directory / WEIGHTS)

    def read(name):
        if name not in f.tensors:
            raise KeyError(name)
        return f.read(name, dtype=np.float32)

    return from_peft(read, cfg, spec, where)


def adapter_config(spec: lora_lib.LoraSpec, base: str | None, cfg: LlamaConfig) -> dict:
    """The adapter_config.json PEFT's `PeftModel.from_pretrained` needs for `spec` (on model
    `cfg`: a mixture of experts adapts its experts through `target_parameters`, its dense
    MLP names only where it has dense layers)."""
    params = experts.target_parameters(spec, cfg)
    modules = [t for t in spec.targets if _has(cfg, t)]
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
        "target_modules": sorted(OURS_TO_PEFT[t] for t in modules) or None,
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": spec.rslora,
    }
    if params:
        out["target_parameters"] = params
    return out


def write_peft(out, adapters: dict, cfg: LlamaConfig, spec: lora_lib.LoraSpec, base: str | None = None) -> dict:
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


def merged_weight(weight: np.ndarray, a: np.ndarray, b: np.ndarray, spec: lora_lib.LoraSpec) -> np.ndarray:
    """One layer's W + scale * A B (computed in f32), in W's dtype and shape."""
    r = spec.rank
    delta = (a.reshape(-1, r).astype(np.float32) @ b.reshape(r, -1).astype(np.float32)) * np.float32(spec.scale)
    return (weight.astype(np.float32) + delta.reshape(weight.shape)).astype(weight.dtype)


def merge(base: dict, adapters: dict, cfg: LlamaConfig, spec: lora_lib.LoraSpec) -> dict:
    """`base` (nested numpy tree of the decoder's params) with each target weight replaced by
    W + scale * A B in W's dtype; every other tensor is `base`'s own array, untouched."""
    out = _copy_dicts(base)
    for w in spec.targets:
        m, per = _module(w), _layers(adapters, cfg, w)
        for path, layers in layer_nodes(cfg) if _has(cfg, w) else ():
            node = _at(out, path)[m]
            weight = np.asarray(node[w])
            if cfg.scan_layers:
                node[w] = np.stack([merged_weight(weight[g], *per[i], spec) for g, i in enumerate(layers)])
            else:
                node[w] = merged_weight(weight, *per[layers[0]], spec)
    for path, layers, sparse in layer_rows(cfg) if cfg.n_experts else ():
        parts = _expert_parts(cfg, spec)
        if not sparse or not parts:
            continue
        node = _at(out, path)["moe"]
        for name in (w for p in parts for w in lora_lib.EXPERT_ADAPTERS[p]):
            per = _layers(adapters, cfg, experts.part_of(name))
            weight = np.asarray(node[name])
            if cfg.scan_layers:
                node[name] = np.stack(
                    [experts.merged_weight(name, weight[g], *per[i], spec) for g, i in enumerate(layers)]
                )
            else:
                node[name] = experts.merged_weight(name, weight, *per[layers[0]], spec)
    return out
