"""The search space of `fsdp_jax.app.planner.search`: what may vary (`SearchSpace`), the
memory budget (`Limits`), every candidate the config's mesh and batch allow
(`enumerate_candidates`) and a candidate as a config (`candidate_config`, `overrides`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Callable
from typing import Any

from fsdp_jax.app.planner.abstract_step import mesh_shape
from fsdp_jax.app.planner.flag_values import STRATEGY_ORDER
from fsdp_jax.app.planner.nvme_plan import is_nvme
from fsdp_jax.errors import SearchError
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.remat import device_policies

OFFLOAD_SETTINGS = (
    "none",
    "optimizer",
    "optimizer+params",
    "optimizer:streamed",
    "optimizer+params:streamed",
    "optimizer+params:streamed-update",
    "optimizer:nvme",
)
# searched only when --offload names them (a run of it has limits: `app.trainer.params_nvme.REFUSALS`)
PLANNED_ONLY = ("optimizer+params:nvme",)
VARY = ("batch", "seq")
# The analytic transient bytes (grads, gathered params, activations: the total minus the
# exact params + optimizer + batch) overstate the compiled program's by at most this much.
# Measured on XLA:GPU for H100: totals 4-32% below at 7B and 70B (docs/planning.md); on a
# 30-candidate tiny grid the transient rest from -44% (full_shard with 2 microbatches) to
# +11% (shard_grad_op, remat none). A candidate is pruned only when `lower_bound` (the rest
# x (1 - ANALYTIC_OVER)) is still over the budget; tests/test_search.py holds it.
ANALYTIC_OVER = 0.5
MIN_SEQ = 16


@dataclasses.dataclass(frozen=True)
class SearchSpace:
    """What to vary. `microbatches` None: every power of two dividing the per-device batch.
    `vary`: "batch" (per-device batch 1, 2, 4, ... up to the config's: the global batch
    changes) and/or "seq" (sequence length halved down to MIN_SEQ, the global batch scaled
    to keep the tokens per step). `attentions`: the attention kernels (`model.attention`) to
    try; empty: the config's (`attention_kernels` gives a target's)."""

    strategies: tuple[str, ...] = STRATEGY_ORDER
    remats: tuple[str, ...] = dataclasses.field(default_factory=device_policies)
    microbatches: tuple[int, ...] | None = None
    offloads: tuple[str, ...] = OFFLOAD_SETTINGS
    vary: tuple[str, ...] = ()
    attentions: tuple[str, ...] = ()


def attention_kernels(cfg, platform: str | None) -> tuple[str, ...]:
    """The kernels a search tries by default: XLA's attention and the platform's flash kernel
    (cuDNN on a GPU, where the compute dtype is bfloat16 / float16 and no context axis: the
    config checks' conditions; splash on a TPU); without a target, the config's alone."""

    flash = {"gpu": "cudnn", "tpu": "splash"}.get(platform or "")
    if flash == "cudnn" and (
        Policy.parse(cfg.precision).compute_dtype.name not in ("bfloat16", "float16") or cfg.mesh.context != 1
    ):
        flash = None
    return tuple(dict.fromkeys((cfg.model.attention, "xla", flash) if flash else (cfg.model.attention,)))


@dataclasses.dataclass(frozen=True)
class Limits:
    """`device_memory` per device; `headroom` kept free (bytes, or a fraction of the device
    memory when `headroom_fraction` is set); `host_memory`: pinned host bytes per host
    (None: unlimited); `disk_bytes_per_s`: a host's local-disk bandwidth (nvme offloads; None:
    the ranking target's, `nvme_plan`); how many candidates to compile."""

    device_memory: int
    headroom: int = 0
    headroom_fraction: float | None = 0.10
    host_memory: int | None = None
    disk_bytes_per_s: float | None = None  # a host's local disks, for nvme offloads (None: the target's)
    top: int = 2
    edge: int = 1
    max_compiles: int = 4

    @property
    def headroom_bytes(self) -> int:
        if self.headroom_fraction is not None:
            return int(self.device_memory * self.headroom_fraction)
        return self.headroom

    @property
    def budget(self) -> int:
        return self.device_memory - self.headroom_bytes

    def memory_for(self, peak: int) -> int:
        """The smallest device memory whose budget holds `peak`."""
        if self.headroom_fraction is not None:
            return math.ceil(peak / (1 - self.headroom_fraction))
        return peak + self.headroom


# ----------------------------------------------------------------------------- candidates


def candidate_config(cfg, c: dict[str, Any]):
    """`cfg` with candidate `c`'s strategy, remat, microbatches, offload, batch, seq and
    attention kernel."""
    return dataclasses.replace(
        cfg,
        model=dataclasses.replace(cfg.model, attention=c.get("attention", cfg.model.attention)),
        remat=c["remat"],
        offload=c["offload"],
        mesh=dataclasses.replace(cfg.mesh, strategy=c["strategy"]),
        train=dataclasses.replace(cfg.train, microbatches=c["microbatches"], global_batch=c["global_batch"]),
        data=dataclasses.replace(cfg.data, seq_len=c["seq_len"]),
    )


def overrides(cfg, c: dict[str, Any]) -> list[str]:
    """Candidate `c` as key=value overrides of `cfg` (batch and seq only where they change)."""
    out = [
        f"mesh.strategy={c['strategy']}",
        f"remat={c['remat']}",
        f"train.microbatches={c['microbatches']}",
        f"offload={c['offload']}",
    ]
    if is_nvme(c["offload"]) and not cfg.offload_dirs.strip():
        out.append("offload_dirs=/nvme0,/nvme1")  # its files' dirs: the node's local NVMe mounts
    if c["global_batch"] != cfg.train.global_batch:
        out.append(f"train.global_batch={c['global_batch']}")
    if c["seq_len"] != cfg.data.seq_len:
        out.append(f"data.seq_len={c['seq_len']}")
    if c.get("attention", cfg.model.attention) != cfg.model.attention:
        out.append(f"model.attention={c['attention']}")
    return out


def _pow2_upto(n: int) -> list[int]:
    return [1 << k for k in range(int(math.log2(n)) + 1)] if n >= 1 else []


def shapes(cfg, n_devices: int, vary: tuple[str, ...]) -> list[tuple[int, int]]:
    """(global batch, seq len) pairs to try."""
    data, fsdp, _ = mesh_shape(cfg, "full_shard", n_devices)
    dp, gb0, seq0 = data * fsdp, cfg.train.global_batch, cfg.data.seq_len
    seqs = [seq0]
    if "seq" in vary:
        seqs += [s for s in (seq0 // 2, seq0 // 4) if s >= MIN_SEQ and seq0 % s == 0]
    out = []
    for s in seqs:
        gbs = [gb0 * seq0 // s]
        if "batch" in vary:
            per_device = max(gb0 // dp, 1) * seq0 // s
            gbs = [p * dp for p in _pow2_upto(per_device)] + [g for g in gbs if g % dp == 0]
        out += [(g, s) for g in dict.fromkeys(gbs)]
    return out


def enumerate_candidates(
    cfg, n_devices: int, space: SearchSpace, mesh_for: Callable[[str], tuple[int, int, int]]
) -> tuple[list[dict], list[str]]:
    """Every valid candidate (batch divisible by microbatches x batch-sharding devices) and
    notes on what was skipped. SearchError when none is valid."""
    notes, out = [], []
    for strategy in space.strategies:
        sizes = mesh_for(strategy)
        if strategy == "hybrid_shard" and sizes[0] == 1 and "full_shard" in space.strategies:
            notes.append("hybrid_shard skipped: with data=1 it is full_shard (set mesh.data or --hosts)")
            continue
        dp = sizes[0] * sizes[1]
        for (gb, seq), remat, offload, attention in itertools.product(
            shapes(cfg, n_devices, space.vary), space.remats, space.offloads, space.attentions or (cfg.model.attention,)
        ):
            if gb % dp:
                continue
            per_device = gb // dp
            mbs = space.microbatches or tuple(_pow2_upto(per_device))
            for m in mbs:
                if per_device % m == 0:
                    out.append(
                        {
                            "strategy": strategy,
                            "remat": remat,
                            "microbatches": m,
                            "offload": offload,
                            "global_batch": gb,
                            "seq_len": seq,
                            "attention": attention,
                            "mesh": dict(zip(("data", "fsdp", "tensor"), map(int, sizes))),
                        }
                    )
    if not out:
        mb = "every power of two" if space.microbatches is None else ",".join(map(str, space.microbatches))
        raise SearchError(
            f"--search: the search space is empty: no microbatch count ({mb}) divides the "
            f"per-device batch of global_batch={cfg.train.global_batch} on {n_devices} devices"
        )
    return out, notes


# ----------------------------------------------------------------------------- analytic pass
