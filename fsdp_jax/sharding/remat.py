"""Activation checkpointing policies, one record each (`RematPolicy`), built on
`jax.checkpoint_policies`.

Models wrap each block with `with_remat(block_fn, name)`; the train step can also wrap
a whole loss function. Names tagged with `jax.ad_checkpoint.checkpoint_name` in
the reference model (`attn_out`, `mlp_out`, `qkv`) can be saved selectively.

A record owns everything the project knows about its policy: the `jax.checkpoint` policy,
which residuals it keeps on the device (`saves`) or copies to host memory (`offloads`),
which forward matmuls the backward pass recomputes (`recomputes`), and whether the
planner's search tries it on the device by default (`search_rank`). The planner's memory
and step-time models read these fields; adding a policy is adding one record to
`REMAT_POLICIES`.

`saves` and `offloads` name residuals as the jax policies select them: `EVERYTHING`
(no remat), `DOTS` (every dot's output), `DOTS_NO_BATCH` (the outputs of dots without
batch dims: the weight matmuls) or a `checkpoint_name` tag (`NAMES`). `recomputes` names
the reference model's matmuls by their outputs (`MATMULS`: `qkv`, `attn_core` (the
attention scores and their product with v), `attn_out`, `gate_up`, `mlp_out`) or
`FORWARD`, the whole forward pass.

The offloading policies keep nothing extra on the device: the residuals they name are
copied to host memory (`offload_dst`, `pinned_host`) in the forward pass and brought back
in the backward pass, instead of being recomputed. They need a backend with host memory
kinds (`fsdp_jax.sharding.offload.host_memory_available`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

cp = jax.checkpoint_policies

EVERYTHING, DOTS, DOTS_NO_BATCH = "everything", "dots", "dots_no_batch"
NAMES = ("qkv", "attn_out", "mlp_out")  # checkpoint_name tags of the reference model
MATMULS = ("qkv", "attn_core", "attn_out", "gate_up", "mlp_out")
FORWARD = "forward"


@dataclasses.dataclass(frozen=True)
class Residual:
    """A value a layer's forward pass makes for its backward pass, as a policy sees it: its
    `checkpoint_name` tag ("" if none), whether a dot makes it, and whether that dot has
    batch dims (the attention's scores and output do; weight matmuls do not)."""

    name: str = ""
    dot: bool = False
    batch_dims: bool = False


def _selects(classes: frozenset[str], r: Residual) -> bool:
    """Does a set of residual classes (`saves` / `offloads`) take `r`?"""
    return (
        EVERYTHING in classes
        or (bool(r.name) and r.name in classes)
        or (r.dot and DOTS in classes)
        or (r.dot and not r.batch_dims and DOTS_NO_BATCH in classes)
    )


@dataclasses.dataclass(frozen=True)
class RematPolicy:
    """One activation checkpointing policy (module docstring).

    name          its key in `REMAT_POLICIES` (the config's `remat:` value)
    policy        the `jax.checkpoint` policy; None: no remat region at all
    saves         residual classes kept on the device for the backward pass
    offloads      residual classes copied to `offload_dst` instead (None: nothing offloaded)
    recomputes    the forward matmuls (`MATMULS`) or the whole `FORWARD` the backward redoes
    search_rank   position among the policies the planner's search tries on the device by
                  default (most kept first); None: tried only when asked for
    """

    name: str
    policy: Callable | None
    saves: frozenset[str] = frozenset()
    offloads: frozenset[str] = frozenset()
    offload_dst: str | None = None
    recomputes: frozenset[str] = frozenset()
    search_rank: int | None = None

    def __post_init__(self):
        for field in ("saves", "offloads", "recomputes"):  # sets given as any iterable
            object.__setattr__(self, field, frozenset(getattr(self, field)))
        if not self.recomputes <= {*MATMULS, FORWARD}:  # the planner has FLOPs for these only
            raise ValueError(
                f"remat {self.name}: recomputes {sorted(self.recomputes)}; allowed: {', '.join(MATMULS)}, {FORWARD}"
            )
        if bool(self.offloads) != bool(self.offload_dst):
            raise ValueError(f"remat {self.name}: offloads and offload_dst go together")

    @property
    def keeps_everything(self) -> bool:
        """No remat: every residual the backward needs stays on the device."""
        return EVERYTHING in self.saves

    def keeps(self, r: Residual) -> bool:
        """Does this policy keep `r` on the device for the backward pass?"""
        return _selects(self.saves, r)

    def sends_to_host(self, r: Residual) -> bool:
        """Does this policy copy `r` to host memory for the backward pass?"""
        return _selects(self.offloads, r)


def _offload(name: str, what: tuple[str, ...], recomputes: tuple[str, ...], policy: Callable) -> RematPolicy:
    return RematPolicy(name, policy, offloads=frozenset(what), offload_dst="pinned_host", recomputes=recomputes)


def _offload_names(*names: str) -> Callable:
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=(),
        names_which_can_be_offloaded=names,
        offload_src="device",
        offload_dst="pinned_host",
    )


_CORE_GATE = ("attn_core", "gate_up")
_RECORDS = (
    RematPolicy("none", None, saves={EVERYTHING}, search_rank=0),
    RematPolicy("full", cp.nothing_saveable, recomputes={FORWARD}, search_rank=5),
    RematPolicy("dots", cp.checkpoint_dots, saves={DOTS}, search_rank=1),
    RematPolicy(
        "dots_no_batch",
        cp.dots_with_no_batch_dims_saveable,
        saves={DOTS_NO_BATCH},
        recomputes={"attn_core"},
        search_rank=2,
    ),
    RematPolicy(
        "save_attn_mlp_out",
        cp.save_only_these_names("attn_out", "mlp_out"),
        saves={"attn_out", "mlp_out"},
        recomputes={"qkv", *_CORE_GATE},
        search_rank=4,
    ),
    RematPolicy(
        "save_qkv_attn_mlp_out",
        cp.save_only_these_names("qkv", "attn_out", "mlp_out"),
        saves={"qkv", "attn_out", "mlp_out"},
        recomputes=_CORE_GATE,
        search_rank=3,
    ),
    # offloaded to host instead of saved on the device or recomputed
    _offload(
        "offload_attn_mlp_out", ("attn_out", "mlp_out"), ("qkv", *_CORE_GATE), _offload_names("attn_out", "mlp_out")
    ),
    _offload(
        "offload_qkv_attn_mlp_out",
        ("qkv", "attn_out", "mlp_out"),
        _CORE_GATE,
        _offload_names("qkv", "attn_out", "mlp_out"),
    ),
    _offload(
        "offload_dots_no_batch",
        (DOTS_NO_BATCH,),
        ("attn_core",),
        cp.offload_dot_with_no_batch_dims("device", "pinned_host"),
    ),
)
# the registry: a policy is one record here (or added to it at run time by its name)
REMAT_POLICIES: dict[str, RematPolicy] = {r.name: r for r in _RECORDS}


def remat_policy(name: str) -> RematPolicy:
    """The record for `name`; unknown names raise ValueError listing the choices."""
    if name not in REMAT_POLICIES:
        raise ValueError(f"unknown remat policy {name!r}; choose one of {', '.join(REMAT_POLICIES)}")
    return REMAT_POLICIES[name]


def get_policy(name: str):
    """The `jax.checkpoint` policy for `name` (None for "none"); unknown names raise ValueError
    listing the choices."""
    return remat_policy(name).policy


def device_policies() -> tuple[str, ...]:
    """The names the planner's search tries on the device by default, most kept first."""
    ranked = [r for r in REMAT_POLICIES.values() if r.search_rank is not None]
    return tuple(r.name for r in sorted(ranked, key=lambda r: r.search_rank))


def offloading() -> frozenset[str]:
    """The names of the policies that copy residuals to host memory."""
    return frozenset(n for n, r in REMAT_POLICIES.items() if r.offloads)


def with_remat(fn: Callable, name: str, **checkpoint_kwargs) -> Callable:
    """`fn` wrapped in `jax.checkpoint` with the named policy (a policy of None returns `fn`)."""
    policy = get_policy(name)
    if policy is None:
        return fn
    return jax.checkpoint(fn, policy=policy, **checkpoint_kwargs)
