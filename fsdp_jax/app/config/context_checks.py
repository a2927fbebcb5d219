"""The run config's checks for context parallelism (`mesh.context` > 1): the zig-zag halves
of `data.seq_len`, the attention kernels that run per ring block, the `length -> context`
rule. Called by `checks.validate` once the mesh sizes are resolved."""

from __future__ import annotations

from typing import Any

from fsdp_jax.app.config.schema import Config
from fsdp_jax.errors import ConfigError

# model.attention values that run as a flash kernel per ring block with mesh.context > 1
# (fsdp_jax.attention.flash.RING_KERNELS); xla runs the ring's own XLA blocks
RING_FLASH_KERNELS = ("splash", "cudnn")


def _check(ok: bool, key: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ConfigError(key, f"{value!r} is invalid; {allowed}")


def check_context(cfg: Config, context_n: int) -> None:
    """Context parallelism (context_n > 1): zig-zag halves of seq_len; XLA attention or a flash
    kernel per ring block (`RING_FLASH_KERNELS`, `_check_flash_blocks`)."""
    if context_n == 1:
        return
    _check(
        cfg.data.seq_len % (2 * context_n) == 0,
        "data.seq_len",
        cfg.data.seq_len,
        f"must be divisible by 2 x mesh.context = {2 * context_n} (the zig-zag layout gives each "
        f"context rank two equal chunks)",
    )
    _check(
        cfg.model.attention in RING_FLASH_KERNELS or cfg.model.attention == "xla",
        "model.attention",
        cfg.model.attention,
        f"cannot run with context parallelism (mesh.context={context_n}): the ring computes each block "
        f"with XLA attention, splash (TPU) or cuDNN (GPU); use model.attention=xla or mesh.context=1",
    )
    _check_flash_blocks(cfg, context_n)
    _check(
        cfg.mesh.rules.get("length") == "context",
        "mesh.rules.length",
        cfg.mesh.rules.get("length"),
        f"must be context with mesh.context={context_n} (the sequence dim is what the axis splits)",
    )


def _check_flash_blocks(cfg: Config, context_n: int) -> None:
    """What a flash kernel per ring block takes (fsdp_jax.attention.splash_block / ring_cudnn):
    splash: half blocks of whole 128-token tiles; cuDNN: no soft cap (packed rows go through
    cuDNN's packed layout per block, fsdp_jax.attention.cudnn_packed). Sliding windows run as
    static bands per chunk pair (fsdp_jax.attention.windows) for both."""
    att = cfg.model.attention
    if att not in RING_FLASH_KERNELS:
        return
    if att == "splash":
        _check(
            cfg.data.seq_len % (2 * context_n * 128) == 0,
            "data.seq_len",
            cfg.data.seq_len,
            f"must be divisible by 2 x mesh.context x 128 = {256 * context_n} with model.attention=splash "
            "(splash's backward wants half blocks of whole 128-token tiles)",
        )
        return
    _check(
        not cfg.model.attn_softcap,
        "model.attn_softcap",
        cfg.model.attn_softcap,
        f"cuDNN per ring block (mesh.context={context_n}) has no soft cap; use model.attention=xla",
    )
