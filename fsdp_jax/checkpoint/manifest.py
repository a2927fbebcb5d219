"""A checkpoint step's manifest, and the names of saved leaves.

`<step>/fsdp_jax_manifest.json` records the size and CRC-32 of every file of the
step's items (`state/`, `extras/`); it is written by the primary process once every
process has written its files, just before orbax renames the tmp directory, so it
commits with the checkpoint. `check_files` compares a step with it before a restore.

Leaves are named by `tree_paths` ("params/blocks/attn/wq"), the same way in a
TrainState, orbax's saved metadata and a safetensors file; `shape_mismatches` lists
the leaves whose shapes differ between two such maps.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import jax

from fsdp_jax.checkpoint.direct_io import crc32

MANIFEST = "fsdp_jax_manifest.json"
TMP_SUFFIX = ".orbax-checkpoint-tmp"
ITEMS = ("state", "extras")  # the items of a step, each a directory
SHARD_INDEX_GLOB = "shards.*.json"  # `shard_files`' per-process index in an item directory


def tree_paths(tree) -> dict[str, Any]:
    """{"params/blocks/attn/wq": leaf, ...}: slash-joined keys, attribute names and
    indices, so a TrainState, its saved metadata and a safetensors file agree."""

    def key(k):
        for attr in ("key", "name", "idx"):
            if hasattr(k, attr):
                return str(getattr(k, attr))
        return str(k)

    return {"/".join(key(k) for k in path): leaf for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]}


def file_crc32(path: str | os.PathLike, chunk: int = 1 << 24) -> str:
    """CRC-32 of a file's bytes as 8 hex digits (zlib's checksum, computed by zlib-ng: `direct_io.crc32`)."""
    crc = 0
    with open(path, "rb") as f:
        while block := f.read(chunk):
            crc = crc32(block, crc)
    return f"{crc:08x}"


def shape_mismatches(saved: dict[str, Any], target: dict[str, Any], limit: int = 10) -> list[str]:
    """Lines `path: checkpoint (shape) vs model (shape)` for leaves whose shapes differ
    or that exist on one side only. Parameters come first; when any parameter differs,
    optimizer-state leaves (which follow them) are only counted."""
    probs: list[tuple[str, str]] = []
    for p in sorted(saved.keys() | target.keys()):
        a, b = saved.get(p), target.get(p)
        if a is None:
            probs.append((p, f"{p}: not in the checkpoint (model {tuple(b.shape)})"))
        elif b is None:
            probs.append((p, f"{p}: only in the checkpoint {tuple(a.shape)}"))
        elif tuple(a.shape) != tuple(b.shape):
            probs.append((p, f"{p}: checkpoint {tuple(a.shape)} vs model {tuple(b.shape)}"))
    params = [m for p, m in probs if p.startswith("params/")]
    others = [m for p, m in probs if not p.startswith("params/")]
    shown = params or others
    out = shown[:limit] + ([f"and {len(shown) - limit} more"] if len(shown) > limit else [])
    if params and others:
        out.append(f"plus {len(others)} optimizer-state/other leaves")
    return out


def shard_crcs(step_dir: Path) -> dict[str, str]:
    """{"state/<file>": CRC-32} of the shard files the step's shard indexes list: computed
    over the bytes as they were written (`shard_files`), so not read back here."""
    out = {}
    for item in ITEMS:
        for index in sorted((step_dir / item).glob(SHARD_INDEX_GLOB)):
            for leaf in json.loads(index.read_text())["leaves"].values():
                out.update({f"{item}/{e['file']}": e["crc32"] for e in leaf["files"]})
    return out


def write_manifest(step_dir: Path, step: int) -> None:
    """Write `step_dir`'s manifest: size and CRC-32 of the item files (orbax rewrites
    its own step metadata after this point, so only the items are listed). Shard files
    take the CRC-32 their writer computed; other files are read for theirs."""
    paths = [f for item in ITEMS for f in sorted((step_dir / item).rglob("*")) if f.is_file()]
    files = {str(f.relative_to(step_dir)): f.stat().st_size for f in paths}
    known = shard_crcs(step_dir)
    crc = {rel: known.get(rel) or file_crc32(step_dir / rel) for rel in files}  # catches flips that keep sizes
    (step_dir / MANIFEST).write_text(json.dumps({"step": step, "files": files, "crc32": crc}, indent=0))


def check_files(step_dir: Path, crc_checked_on_read: bool = False) -> str | None:
    """Compare `step_dir`'s files with its manifest: None when all are there with their
    sizes and CRC-32 checksums (manifests written before checksums: sizes only); else
    the problem (first missing, resized or changed file). `crc_checked_on_read`: the
    caller's reader checks the shard files' CRC-32s as it reads them (`shard_files`), so
    only their sizes are checked here. Raises FileNotFoundError when the step has no
    manifest."""
    manifest = json.loads((step_dir / MANIFEST).read_text())
    crc = manifest.get("crc32", {})
    for rel, size in manifest["files"].items():
        f = step_dir / rel
        if not f.is_file():
            return f"{rel} is missing"
        if f.stat().st_size != size:
            return f"{rel} has {f.stat().st_size} bytes, {size} when saved"
    skip: dict[str, str] = {}
    if crc_checked_on_read:
        try:  # a damaged index skips nothing: its own CRC-32 below names it
            skip = shard_crcs(step_dir)
        except (ValueError, KeyError, TypeError, AttributeError):
            skip = {}
    for rel in manifest["files"]:
        if rel in crc and rel not in skip and file_crc32(step_dir / rel) != crc[rel]:
            return f"{rel} has changed since it was saved (CRC-32 {file_crc32(step_dir / rel)}, {crc[rel]} when saved)"
    return None
