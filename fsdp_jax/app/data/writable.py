"""Whether a path can be written, asked before anything is: `dir_problem` (a directory to
create or fill). JAX-free and NumPy-free, so a command refuses an output path it cannot
write before JAX loads (`fsdp_jax.app.cli.args.check_out_file`, run in `before`)."""

from __future__ import annotations

import os
from pathlib import Path


def dir_problem(path: str | os.PathLike) -> str | None:
    """Why `path` cannot be (created as) a writable directory, or None: it is a file, it
    lies under a file, or its nearest existing ancestor is not writable. Writes nothing."""
    p = Path(path).absolute()
    if p.exists() and not p.is_dir():
        return "is a file, not a directory"
    existing = p
    while not existing.exists():  # a path under a file does not "exist" either
        existing = existing.parent
    if not existing.is_dir():
        return f"lies under {str(existing)!r}, which is a file"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"is not writable ({str(existing)!r} is read-only for this user); choose a writable place"
    return None
