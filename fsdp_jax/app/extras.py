"""Optional features and the package extra that installs each.

    pip install 'fsdp_jax[tensorboard]'   # train.tensorboard=true (tensorboardX)
    pip install 'fsdp_jax[plot]'          # scripts' --plot, plot.py (matplotlib)
    pip install 'fsdp_jax[data]'          # .parquet and datasets-directory sources (pyarrow)
    pip install 'fsdp_jax[all]'           # both

The core install (jax, flax, optax, orbax, grain) trains, checkpoints, exports
safetensors (written and read by fsdp_jax.checkpoint itself, no package needed) and
plans. A feature whose package is missing fails before any work with one line naming
the feature and the pip command.
"""

from __future__ import annotations

import importlib
import importlib.util

from fsdp_jax.errors import MissingExtra

EXTRAS = {"tensorboardX": "tensorboard", "matplotlib": "plot", "pyarrow": "data"}  # import name -> extra


def missing_message(module: str, feature: str) -> str:
    return (
        f"{feature} needs the {module} package, which is not installed; "
        f"pip install 'fsdp_jax[{EXTRAS[module]}]' (or pip install {module})"
    )


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, feature: str):
    """Import `module` for `feature`, or raise MissingExtra with the install line."""
    if not available(module):
        raise MissingExtra(missing_message(module, feature))
    return importlib.import_module(module)
