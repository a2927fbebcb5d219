"""The remat policies' names: data, no JAX. The run config's checks read `remat:` against them
before JAX loads (`fsdp_jax.app.config.early_checks`); `fsdp_jax.sharding.remat` holds the
records (`REMAT_POLICIES`, in this order; tests/test_config.py pins the two together).
"""

from __future__ import annotations

import sys

REMAT_NAMES: tuple[str, ...] = (
    "none",
    "full",
    "dots",
    "dots_no_batch",
    "save_attn_mlp_out",
    "save_qkv_attn_mlp_out",
    "offload_attn_mlp_out",
    "offload_qkv_attn_mlp_out",
    "offload_dots_no_batch",
)


def remat_names() -> tuple[str, ...]:
    """The names `remat:` takes: `REMAT_NAMES`, or once `fsdp_jax.sharding.remat` is loaded its
    `REMAT_POLICIES` as they are now (a policy may be added to it at run time)."""
    live = sys.modules.get("fsdp_jax.sharding.remat")
    return REMAT_NAMES if live is None else tuple(live.REMAT_POLICIES)
