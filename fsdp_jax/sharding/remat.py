"""Activation checkpointing policies by name, built on `jax.checkpoint_policies`.

Models wrap each block with `with_remat(block_fn, name)`; the train step can also wrap
a whole loss function. Names tagged with `jax.ad_checkpoint.checkpoint_name` in
the reference model (`attn_out`, `mlp_out`, `qkv`) can be saved selectively.

The `offload_*` policies keep nothing extra on the device either: the residuals they
name are copied to host memory (`pinned_host`) in the forward pass and brought back in
the backward pass, instead of being recomputed. They need a backend with host memory
kinds (`fsdp_jax.sharding.offload.host_memory_available`); `OFFLOADING` lists them.
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
    # offloaded to host instead of saved on the device or recomputed
    "offload_attn_mlp_out": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=("attn_out", "mlp_out"),
        offload_src="device",
        offload_dst="pinned_host",
    ),
    "offload_qkv_attn_mlp_out": cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=("qkv", "attn_out", "mlp_out"),
        offload_src="device",
        offload_dst="pinned_host",
    ),
    "offload_dots_no_batch": cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
}
OFFLOADING = frozenset(n for n in REMAT_POLICIES if n.startswith("offload_"))


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
