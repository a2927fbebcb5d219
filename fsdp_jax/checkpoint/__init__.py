"""Checkpoints: asynchronous sharded saves (Orbax steps, raw shard files), restore onto any mesh, export.

One concept per module:

- `checkpointer`: `Checkpointer` (save / restore / list steps), `restore`, `latest_step`
- `manifest`: the per-step manifest (sizes, CRC-32), leaf names (`tree_paths`) and
  `shape_mismatches`
- `fits`: whether a saved state fits a restore target, and the leaves a restore may create as
  zeros (an older checkpoint of a model that gained them: `Checkpointer.restore(fill_missing=)`,
  `filled_note`)
- `shard_files`: arrays as one raw file per distinct host shard + a JSON index, restored onto
  any layout with CRC-32s checked on read; `shard_handler`: that as an Orbax item handler
  (the Checkpointer's default payload); `direct_io`: files written and read with O_DIRECT
- `params_io`: params as safetensors: `export_safetensors`, `load_safetensors`,
  `load_init_params` (a run's `init_from`)
- `safetensors_io`: the safetensors format itself (checked headers, sliced reads, streamed
  writes), which the Hugging Face import and export use too
- `orbax_logs`: orbax's tracebacks after a failed save, quieted (reported once instead)

The names below load on first use, so importing `fsdp_jax.checkpoint.safetensors_io` (or this
package) loads no Orbax. See docs/checkpoints.md.
"""

import importlib

_FACE = {
    "Checkpointer": "checkpointer",
    "Restored": "checkpointer",
    "latest_step": "checkpointer",
    "restore": "checkpointer",
    "ITEMS": "manifest",
    "MANIFEST": "manifest",
    "TMP_SUFFIX": "manifest",
    "check_files": "manifest",
    "file_crc32": "manifest",
    "filled_note": "fits",
    "shape_mismatches": "manifest",
    "tree_paths": "manifest",
    "export_safetensors": "params_io",
    "load_init_params": "params_io",
    "load_safetensors": "params_io",
    "open_safetensors": "params_io",
}
__all__ = [
    "Checkpointer",
    "ITEMS",
    "MANIFEST",
    "Restored",
    "TMP_SUFFIX",
    "check_files",
    "export_safetensors",
    "file_crc32",
    "filled_note",
    "latest_step",
    "load_init_params",
    "load_safetensors",
    "open_safetensors",
    "restore",
    "shape_mismatches",
    "tree_paths",
    "CheckpointError",
    "CheckpointWriteError",
]


def __getattr__(name: str):
    if name in ("CheckpointError", "CheckpointWriteError"):
        return getattr(importlib.import_module("fsdp_jax.errors"), name)
    if name in _FACE:
        return getattr(importlib.import_module(f"{__name__}.{_FACE[name]}"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
