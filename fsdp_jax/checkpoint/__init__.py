"""Checkpoints: asynchronous sharded saves with Orbax, restore onto any mesh, export.

One concept per module:

- `checkpointer`: `Checkpointer` (save / restore / list steps), `restore`, `latest_step`
- `manifest`: the per-step manifest (sizes, CRC-32), leaf names (`tree_paths`) and
  `shape_mismatches`
- `params_io`: params as safetensors: `export_safetensors`, `load_safetensors`,
  `load_init_params` (a run's `init_from`)
- `orbax_logs`: orbax's tracebacks after a failed save, quieted (reported once instead)

Every name below is importable from `fsdp_jax.checkpoint` as before the split; the
files on disk are unchanged. See docs/checkpoints.md.
"""

from fsdp_jax.checkpoint.checkpointer import Checkpointer, Restored, latest_step, restore
from fsdp_jax.checkpoint.manifest import (
    ITEMS,
    MANIFEST,
    TMP_SUFFIX,
    check_files,
    file_crc32,
    shape_mismatches,
    tree_paths,
)
from fsdp_jax.checkpoint.params_io import export_safetensors, load_init_params, load_safetensors, open_safetensors
from fsdp_jax.errors import CheckpointError, CheckpointWriteError, one_line

_ITEMS = ITEMS  # the name before the split

__all__ = [
    "Checkpointer",
    "Restored",
    "latest_step",
    "restore",
    "MANIFEST",
    "TMP_SUFFIX",
    "check_files",
    "file_crc32",
    "shape_mismatches",
    "tree_paths",
    "export_safetensors",
    "load_init_params",
    "load_safetensors",
    "open_safetensors",
    "CheckpointError",
    "CheckpointWriteError",
    "one_line",
]
