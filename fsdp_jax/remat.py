"""Activation checkpointing policies by name, built on `jax.checkpoint_policies`.

Models wrap each block with `with_remat(block_fn, name)`; the train step can also wrap
a whole loss function. Names tagged with `jax.ad_checkpoint.checkpoint_name` in
the reference model (`attn_out`, `mlp_out`, `qkv`) can be saved selectively.
"""

from __future__ import annotations

from collections.abc import Callable

import jax

cp = jax.checkpoint_policies

# None means "no remat": keep every activation for the backward pass.
REMAT_POLICIES: dict[str, Callable | None] = {
    "none": None,
    "full": cp.nothing_saveable,
    "dots": cp.checkpoint_dots,
    "dots_no_batch": cp.dots_with_no_batch_dims_saveable,
    "save_attn_mlp_out": cp.save_only_these_names("attn_out", "mlp_out"),
    "save_qkv_attn_mlp_out": cp.save_only_these_names("qkv", "attn_out", "mlp_out"),
}


def get_policy(name: str):
    """The `jax.checkpoint` policy for `name`; unknown names raise ValueError listing the choices."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {name!r}; choose one of {', '.join(REMAT_POLICIES)}")
    return REMAT_POLICIES[name]


def with_remat(fn: Callable, name: str, **checkpoint_kwargs) -> Callable:
    """`fn` wrapped in `jax.checkpoint` with the named policy ("none" returns `fn`)."""
    if name == "none":
        get_policy(name)
        return fn
    return jax.checkpoint(fn, policy=get_policy(name), **checkpoint_kwargs)
