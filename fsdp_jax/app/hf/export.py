"""A run's params -> a Hugging Face directory of its family that `from_pretrained` loads.

    export_hf("runs/ft", "out/ft-hf", dtype="bfloat16")   # scripts/export.py RUN --hf OUT

Writes `config.json` in the model's family (a registered one,
`fsdp_jax.app.models.families`: the one the run was imported from when it still fits,
else the first whose config maps back onto exactly this architecture;
`fsdp_jax.app.hf.config_out.config_json`),
with both the transformers 5.x `rope_parameters` and the 4.x `rope_scaling` /
top-level `rope_theta`, so an older transformers does not load default RoPE; the
weights as `model.safetensors`, or as `model-0000i-of-0000n.safetensors` plus
`model.safetensors.index.json` when they exceed `max_shard_bytes`, and the tokenizer files of the model it was imported from
(or of the corpus), `chat_template.jinja` included (transformers 5 keeps a chat template only
there; a packed corpus' own copy, the template its chats were rendered with, comes first). The model config comes from the checkpoint's saved config.

Leaves are read one at a time from the checkpoint (never the optimizer state); the
tensors are ordered leaf by leaf (all layers' q_proj, then all k_proj, ...) so each
stacked leaf is read once; the index maps each name to its file, which is all
`from_pretrained` needs. Everything goes to a temporary directory renamed to OUT at
the end; each file is re-read with the `safetensors` library before that.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

import numpy as np

from fsdp_jax.app.config.parse import config_from_dict
from fsdp_jax.app.hf import layouts, load, moe_layout, mtp_layout
from fsdp_jax.app.hf.config_out import config_json
from fsdp_jax.app.models.config import DecoderConfig
from fsdp_jax.app.models.decoder import Decoder
from fsdp_jax.checkpoint import Checkpointer, CheckpointError, shape_mismatches, tree_paths
from fsdp_jax.checkpoint.safetensors_io import check_file, write_safetensors
from fsdp_jax.errors import ConfigError
from fsdp_jax.model.fns import from_nnx

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer.model",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",  # transformers 5 keeps a tokenizer's chat template only here
)
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' default max_shard_size "5GB"


def hf_config(cfg: DecoderConfig, dtype: str, token_ids: dict | None = None, hint: str | None = None) -> dict:
    """config.json for `cfg` in its family (`hint`: the model_type to prefer), keys as
    transformers writes them, sorted (fsdp_jax.app.hf.config_out.config_json)."""
    return config_json(cfg, dtype, token_ids, hint)


def _pick_step(ckpt: Checkpointer, step: int | None) -> int:
    """`Checkpointer.usable_step`: the newest step whose files match their manifest (sizes
    and CRC-32), or exactly `step`; a damaged newer step is skipped with a warning naming it."""
    s, notes = ckpt.usable_step(step)
    for note in notes:
        print(f"warning: {note}", flush=True)
    return s


def check_out_dir(out: Path, flag: str) -> None:
    """CheckpointError (one line) unless `out` can become a new directory."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{flag} {out}: already exists; choose a new directory")
    if not out.absolute().parent.is_dir():
        raise CheckpointError(f"{flag} {out}: its parent directory does not exist")


def saved_source(directory, step: int | None):
    """(read-only checkpointer, its newest usable step or `step`, that step's run config)."""
    ckpt = Checkpointer(directory, read_only=True)
    s = _pick_step(ckpt, step)
    return ckpt, s, _saved_config(ckpt, s)


def _saved_config(ckpt: Checkpointer, step: int):
    import orbax.checkpoint as ocp

    try:
        extras = ocp.Checkpointer(ocp.JsonCheckpointHandler()).restore(
            ckpt.step_dir(step) / "extras", args=ocp.args.JsonRestore()
        )
        return config_from_dict(extras["config"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        if isinstance(e, ConfigError):
            raise CheckpointError(f"{ckpt.step_dir(step)}: saved config is invalid ({e})") from None
        raise CheckpointError(
            f"{ckpt.step_dir(step)}: no saved run config in extras/ ({e}); "
            "export it with a run directory written by scripts/train.py"
        ) from None


def _token_ids_and_tokenizer(cfg) -> tuple[dict, list[tuple[Path, str]]]:
    """(bos/eos/pad ids for config.json, [(tokenizer file, name to copy it as)]) from
    the HF model the run was imported from, else from the corpus' tokenizer."""
    if load.is_hf(cfg.init_from) and (load.hf_dir(cfg.init_from) / "config.json").is_file():
        src = load.hf_dir(cfg.init_from)
        raw = json.loads((src / "config.json").read_text())
        ids = {k: raw[k] for k in ("bos_token_id", "eos_token_id", "pad_token_id") if k in raw}
        return ids, [(src / f, f) for f in TOKENIZER_FILES if (src / f).is_file()]
    meta = Path(cfg.data.path) / "meta.json"
    try:
        m = json.loads(meta.read_text())
    except (OSError, ValueError):
        return {}, []
    tok = m.get("tokenizer")
    if tok in (None, "bytes", "external") or not Path(tok).is_file():
        return {}, []
    main = (Path(tok), "tokenizer.json" if Path(tok).suffix == ".json" else "tokenizer.model")
    side = [(Path(tok).parent / f, f) for f in TOKENIZER_FILES[2:] if (Path(tok).parent / f).is_file()]
    trained = meta.parent / str(m.get("chat_template") or "")
    if m.get("chat_template") and trained.is_file():  # the template a packed corpus' chats were rendered with
        side = [x for x in side if x[1] != "chat_template.jinja"] + [(trained, "chat_template.jinja")]
    return ({"eos_token_id": m["eos_id"]} if "eos_id" in m else {}), [main] + side


def _shard_files(entries: list, max_shard_bytes: int) -> tuple[list[list], list[str]]:
    """`entries` (name, shape, dtype) in files of at most `max_shard_bytes` each (a larger
    tensor gets a file of its own), and the files' names as Hugging Face numbers them."""
    files: list[list] = [[]]
    size = 0
    for e in entries:
        n = math.prod(e[1]) * e[2].itemsize
        if files[-1] and size + n > max_shard_bytes:
            files.append([])
            size = 0
        files[-1].append(e)
        size += n
    names = (
        ["model.safetensors"]
        if len(files) == 1
        else [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    )
    return files, names


def _decoder_params(cfg: DecoderConfig):
    """The reference decoder's abstract params for `cfg` (shapes and dtypes, nothing allocated)."""

    return from_nnx(lambda rngs: Decoder(cfg, rngs=rngs)).abstract_params


def _checked_source(directory, step: int | None, abstract_params=None):
    """(checkpointer, step, its run config, its saved params' metadata, the model_type to
    prefer): the step's params match its saved model config and some family computes that
    model. CheckpointError (one line) otherwise, before anything is written."""
    ckpt = Checkpointer(directory, read_only=True)
    s = _pick_step(ckpt, step)
    run_cfg = _saved_config(ckpt, s)
    cfg = run_cfg.model
    abstract = (abstract_params or _decoder_params)(cfg)
    want = tree_paths({"params": abstract})
    saved = {p: m for p, m in ckpt.saved_metadata(s).items() if p.startswith("params/")}
    bad = shape_mismatches(saved, want)
    if bad:
        raise CheckpointError(f"{ckpt.step_dir(s)}: params do not match its saved model config ({'; '.join(bad)})")
    hint = None
    if load.is_hf(run_cfg.init_from) and (load.hf_dir(run_cfg.init_from) / "config.json").is_file():
        hint = load.read_config_json(load.hf_dir(run_cfg.init_from)).get("model_type")
    try:
        hf_config(cfg, "float32", hint=hint)  # refuses before anything is written
    except ConfigError as e:
        raise CheckpointError(f"{ckpt.step_dir(s)}: {e}") from None
    return ckpt, s, run_cfg, saved, hint


def _tensor_entries(cfg: DecoderConfig, saved: dict, out_dt) -> tuple[list, dict]:
    """([(HF name, shape, dtype)] leaf by leaf, {HF name: (our leaf path, layer index or
    None, kind)}); `out_dt` None keeps each leaf's saved dtype."""
    shapes = load.expected_tensors(cfg)
    entries, source = [], {}
    for path, (names, kind) in load.leaf_sources(cfg).items():
        stacked = moe_layout.is_stacked(cfg, path)
        dt = out_dt or np.dtype(saved[f"params/{path}"].dtype)
        experts = range(cfg.n_experts) if kind.startswith(moe_layout.EXPERT_KIND) else [None]
        for i, name in enumerate(names):
            for e in experts:  # an expert leaf: one HF tensor per expert
                n = name if e is None else name.format(e=e)
                entries.append((n, shapes[n], dt))
                source[n] = (path, i if stacked else None, kind, e)
    for n, (path, kind) in mtp_layout.copies(cfg).items():  # an MTP layer's copies of the embedding and head
        entries.append((n, shapes[n], out_dt or np.dtype(saved[f"params/{path}"].dtype)))
        source[n] = (path, None, kind, None)
    return entries, source


def _leaf_reader(read_leaf, source: dict):
    """HF name -> its tensor, `read_leaf(path)` one leaf in host memory at a time."""
    cache: dict[str, np.ndarray] = {}

    def fetch(name: str) -> np.ndarray:
        path, layer, kind, expert = source[name]
        if path not in cache:
            cache.clear()  # one leaf in host memory at a time
            cache[path] = np.asarray(read_leaf(path))
        arr = cache[path] if layer is None else cache[path][layer]
        return layouts.to_hf(kind, arr, expert)

    return fetch


def _write_weights(tmp: Path, names: list[str], files: list[list], entries: list, fetch) -> int:
    """The safetensors files (each read back and checked) and, when there are several, their
    index; returns the bytes written."""
    total = 0
    for fname, group in zip(names, files):
        total += write_safetensors(tmp / fname, group, fetch, {"format": "pt"})
        got = check_file(tmp / fname)
        for name, shape, dt in group:
            if got.get(name, (None,))[0] != list(shape):
                raise RuntimeError(f"{fname}: {name} reads back as {got.get(name)}")
    if len(files) > 1:
        index = {
            "metadata": {
                "total_size": sum(math.prod(e[1]) * e[2].itemsize for e in entries),
                "total_parameters": sum(math.prod(e[1]) for e in entries),
            },
            "weight_map": dict(sorted((e[0], f) for f, g in zip(names, files) for e in g)),
        }
        (tmp / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
    return total


def export_hf(
    directory: str | os.PathLike,
    out: str | os.PathLike,
    *,
    dtype: str | None = None,
    step: int | None = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    abstract_params=None,
) -> dict:
    """Export checkpoint `directory`'s params (newest usable step, or `step`) as a
    Hugging Face Llama directory `out` (must not exist, or be empty). `dtype` casts
    the floating params (default: as saved). `abstract_params(model_cfg)` gives the tree the
    saved params must match (default: the reference decoder's). Returns {"step", "files", "tensors",
    "bytes", "path"}. Raises CheckpointError (one line) on bad input, writing nothing."""
    out = Path(out)
    check_out_dir(out, "--hf")
    ckpt, s, run_cfg, saved, hint = _checked_source(directory, step, abstract_params)
    saved_dtypes = {p.removeprefix("params/"): np.dtype(m.dtype) for p, m in saved.items()}
    info = write_hf_dir(
        out, run_cfg, hint, saved_dtypes, lambda p: ckpt.read_leaf(s, f"params/{p}"), dtype, max_shard_bytes
    )
    return {"step": s, **info}


def write_hf_dir(
    out: Path, run_cfg, hint, saved_dtypes: dict, read_leaf, dtype=None, max_shard_bytes=DEFAULT_MAX_SHARD_BYTES
):
    """Write the Hugging Face directory `out` (checked by the caller) of `run_cfg`'s model
    from `read_leaf(our param path) -> array` (leaves of dtypes `saved_dtypes`, by path).
    Returns {"files", "tensors", "bytes", "path"}."""
    cfg = run_cfg.model
    out_dt = np.dtype(dtype) if dtype else None
    entries, source = _tensor_entries(cfg, {f"params/{p}": _Dt(d) for p, d in saved_dtypes.items()}, out_dt)
    files, names = _shard_files(entries, max_shard_bytes)
    token_ids, tok_files = _token_ids_and_tokenizer(run_cfg)
    tmp = out.absolute().parent / f".{out.name}.tmp.{os.getpid()}"
    try:
        tmp.mkdir()
        total = _write_weights(tmp, names, files, entries, _leaf_reader(read_leaf, source))
        float_dt = (out_dt or np.dtype(entries[0][2])).name
        (tmp / "config.json").write_text(json.dumps(hf_config(cfg, float_dt, token_ids, hint), indent=2) + "\n")
        for f, target in tok_files:
            shutil.copyfile(f, tmp / target)
        if out.exists():
            out.rmdir()  # empty, checked above
        os.replace(tmp, out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return {"files": len(files), "tensors": len(entries), "bytes": total, "path": str(out)}


class _Dt:
    """A saved leaf's dtype, as `_tensor_entries` reads it from the metadata."""

    def __init__(self, dtype):
        self.dtype = dtype
