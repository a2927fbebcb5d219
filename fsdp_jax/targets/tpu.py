"""TPU targets for deviceless compiles: the chips' published specifications, slice
topologies, and libtpu in a private folder.

    python -m fsdp_jax.targets install tpu        # once: libtpu pinned to this jax (~680 MB)
    t = targets.make_target("v5p", devices=64, slices=2)   # 2 slices of v5p:2x4x4 (32 chips each)
    # in a child process with env=targets.child_env(target=t):
    devices = targets.target_devices(t)       # compile-only TPU devices, slice-major

libtpu, like the CUDA plugin, turns a CPU machine into a compiler for the chip:
`jax.experimental.topologies.get_topology_desc(topology_name="v5p:2x2x2",
platform="tpu", num_slices=N)` gives compile-only devices of N slices, and
`jit(...).lower(...).compile()` runs XLA:TPU with a real `memory_analysis()`,
`cost_analysis()` and the scheduled TPU HLO. It is installed with `pip install
--target` into its own folder (never site-packages: libtpu in a CPU process makes JAX
probe for TPUs and log about `TPU_WORKER_HOSTNAMES`) and only the compiling child puts it
on its path (`fsdp_jax.targets.gpu.child_env`).

Names follow Cloud TPU: a generation (`v4`, `v5e`, `v5p`, `v6e`) with `--devices` chips per
slice set, or an accelerator type (`v5p-64`, `v6e-256`): v4 and v5p count TensorCores
there (2 per chip), v5e and v6e count chips.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math
import re

import jax
import numpy as np
from jax.experimental import topologies

from fsdp_jax.errors import TopologyError


@dataclasses.dataclass(frozen=True)
class TpuSpec:
    """Per-chip figures of one TPU generation: peak FLOP/s and bandwidths as published
    (Cloud TPU system-architecture pages, `source`); `hbm_bytes` is the HBM XLA:TPU itself
    lets a program use (it refuses to compile a program whose temporaries exceed it, and
    names the figure: v5p 95.74 GiB of the published 95 GB / 96 GiB, v6e 31.25 GiB of
    32, v5e 15.75 GiB of 16, v4 15.25 GiB per core; libtpu 0.0.42.1). `ici_bw`:
    bidirectional inter-chip bandwidth per chip, bytes/s; `dcn_bw`: data-center network
    bandwidth per chip, bytes/s (None where the pages give none)."""

    name: str
    device_kind: str  # what jax's compile-only devices call it
    hbm_bytes: int
    peak_bf16_flops: float
    hbm_bw: float  # bytes/s
    ici_bw: float | None
    dims: int  # torus dimensions: 2 (v5e, v6e) or 3 (v4, v5p)
    cores_in_name: bool  # accelerator type counts TensorCores (2 per chip), not chips
    max_chips: int  # largest single slice
    source: str
    devices_per_chip: int = 1  # compile-only devices libtpu makes of one chip (v4: its 2 cores)
    dcn_bw: float | None = None


GB, GIB = 10**9, 2**30
TPU_SPECS: dict[str, TpuSpec] = {
    s.name: s
    for s in (
        # Figures from the Cloud TPU system-architecture pages (docs.cloud.google.com/tpu/docs/<gen>,
        # read 2026-12): v4 gives no per-chip ICI figure, so it is the page's all-reduce
        # bandwidth per Pod (1.1 PB/s over 4096 chips) x 2 directions; v5p's page now gives
        # ICI 1200 GBps bidirectional and DCN 50 Gbps per chip (its older text: "Interchip
        # Interconnect BW 4800 Gbps"); v5e's DCN is its 2 x 100 Gbps NICs per 8-chip host.
        TpuSpec(
            "v4",
            "TPU v4",
            int(30.5 * GIB),
            275e12,
            1200 * GB,
            2 * 1.1e15 / 4096,
            3,
            True,
            4096,
            "cloud.google.com/tpu/docs/v4: 275 TFLOP/s bf16, HBM2 32 GiB at 1200 GBps, all-reduce "
            "1.1 PB/s per 4096-chip Pod",
            2,
        ),
        TpuSpec(
            "v5e",
            "TPU v5 lite",
            int(15.75 * GIB),
            197e12,
            819 * GB,
            400 * GB,
            2,
            False,
            256,
            "cloud.google.com/tpu/docs/v5e: 197 TFLOP/s bf16, HBM2 16 GB at 819 GBps, ICI 400 GBps "
            "bidirectional, 2 x 100 Gbps NICs per 8-chip host",
            dcn_bw=2 * 100e9 / 8 / 8,
        ),
        TpuSpec(
            "v5p",
            "TPU v5",
            int(95.74 * GIB),
            459e12,
            2765 * GB,
            1200 * GB,
            3,
            True,
            8960,
            "cloud.google.com/tpu/docs/v5p: 459 TFLOP/s bf16, HBM2e 95 GiB at 2765 GBps, ICI 1200 GBps "
            "bidirectional, DCN 50 Gbps per chip",
            dcn_bw=50e9 / 8,
        ),
        TpuSpec(
            "v6e",
            "TPU v6 lite",
            int(31.25 * GIB),
            918e12,
            1638 * GB,
            800 * GB,
            2,
            False,
            256,
            "cloud.google.com/tpu/docs/v6e: 918 TFLOP/s bf16, HBM 32 GB at 1638 GBps, ICI 800 GBps bidirectional",
        ),
    )
}
_TYPE = re.compile(r"^(v\d+[a-z]*)-(\d+)$")


def is_tpu(name: str) -> bool:
    """True for a TPU generation (`v5p`) or accelerator type (`v5p-64`)."""
    m = _TYPE.match(name)
    return (m.group(1) if m else name) in TPU_SPECS or bool(re.match(r"^v\d", name))


def split_name(name: str) -> tuple[TpuSpec, int | None]:
    """(spec, chips per slice or None) from `v5p` or `v5p-64`. Raises TopologyError."""
    m = _TYPE.match(name)
    gen, count = (m.group(1), int(m.group(2))) if m else (name, None)
    if gen not in TPU_SPECS:
        raise TopologyError(f"--target: unknown TPU generation {gen!r}; known: {', '.join(TPU_SPECS)}")
    spec = TPU_SPECS[gen]
    if count is None:
        return spec, None
    if spec.cores_in_name and count % 2:
        raise TopologyError(
            f"--target: {name!r}: {gen} accelerator types count TensorCores, 2 per chip; {count} is odd"
        )
    return spec, count // 2 if spec.cores_in_name else count


def default_topology(spec: TpuSpec, chips: int) -> str:
    """The usual slice shape of `chips` chips: 2-D `AxB` (v5e, v6e) or 3-D `AxBxC` (v4,
    v5p), dims powers of two, as square as they go. Raises TopologyError when `chips` is
    not a power of two or exceeds the generation's largest slice."""
    if chips < 1 or chips & (chips - 1) or chips > spec.max_chips:
        raise TopologyError(
            f"--devices: {chips} chips per slice is not a {spec.name} slice size "
            f"(a power of two up to {spec.max_chips}); give --topology"
        )
    dims = [1] * spec.dims
    for _ in range(int(math.log2(chips))):
        dims[dims.index(min(dims))] *= 2
    return "x".join(str(d) for d in sorted(dims, key=lambda d: (d == 1, d)))  # 2x2x1, 2x4x4


def parse_topology(spec: TpuSpec, text: str) -> tuple[str, int]:
    """(`AxB[xC]`, chips) checked against the generation's torus dimensions."""
    parts = text.split("x")
    if len(parts) != spec.dims or not all(p.isdigit() and int(p) > 0 for p in parts):
        example = "2x2x2" if spec.dims == 3 else "4x4"
        raise TopologyError(f"--topology: {text!r} is not a {spec.dims}-D {spec.name} topology (e.g. {example})")
    chips = math.prod(int(p) for p in parts)
    if chips > spec.max_chips:
        raise TopologyError(f"--topology: {text!r} has {chips} chips; a {spec.name} slice has at most {spec.max_chips}")
    return text, chips


def device_peaks(name: str) -> dict[str, float | None]:
    """Roofline figures per compile-only device of TPU generation `name` (v4: a core, half a
    chip): `flops` (dense bf16 peak), `fast` (ICI bytes/s one device sends: half the
    bidirectional figure, which is also the pages' all-reduce bandwidth per chip), `slow`
    (data-center network bytes/s, None where unpublished) and `hbm` (bytes/s)."""
    spec = split_name(name)[0]
    k = spec.devices_per_chip
    return {
        "flops": spec.peak_bf16_flops / k,
        "fast": spec.ici_bw / 2 / k,
        "slow": spec.dcn_bw / k if spec.dcn_bw else None,
        "hbm": spec.hbm_bw / k,
    }


def tiled_bytes(shape, itemsize: int, layout) -> int:
    """Bytes XLA:TPU allocates for an array of `shape` in `layout` (a compiled program's
    `input_formats[...].layout`: `major_to_minor` and `tiling`): the minor-most dims, in
    memory order, padded up to the first-level tile (e.g. (8, 128) for f32 matrices, (128,)
    for a scalar, which takes 128 elements). Inner tile levels only reorder within a tile."""
    dims = [shape[i] for i in layout.major_to_minor] or [1]
    tile = layout.tiling[0] if layout.tiling else ()
    dims = [1] * (len(tile) - len(dims)) + dims
    for k, t in enumerate(tile, start=len(dims) - len(tile)):
        dims[k] = -(-dims[k] // t) * t
    return math.prod(dims) * itemsize


def tile_padding(args, compiled) -> int:
    """Bytes per device XLA:TPU adds to the arguments `args` (a pytree of sharded arrays or
    ShapeDtypeStructs, in the order the step takes them) by padding each shard to the tiles
    of `compiled`'s own input layouts (`tiled_bytes` minus the shard's bytes). Host-resident
    arguments count too, as memory_analysis()'s argument bytes count them."""

    leaves = jax.tree.leaves(args)
    layouts = [f.layout for f in jax.tree.leaves(compiled.input_formats, is_leaf=lambda f: hasattr(f, "layout"))]
    if len(layouts) != len(leaves):
        raise ValueError(f"{len(leaves)} arguments but {len(layouts)} input layouts")
    total = 0
    for x, layout in zip(leaves, layouts):
        shape, itemsize = x.sharding.shard_shape(x.shape), np.dtype(x.dtype).itemsize
        total += tiled_bytes(shape, itemsize, layout) - math.prod(shape) * itemsize
    return total


def libtpu_requirement() -> str:
    """The libtpu pin of the installed jax's `tpu` extra (e.g. `libtpu==0.0.42.*`)."""
    for req in importlib.metadata.requires("jax") or []:
        spec, _, marker = req.partition(";")
        if spec.strip().startswith("libtpu") and "tpu" in marker:
            return spec.replace(" ", "")
    raise RuntimeError("this jax declares no libtpu version (no `tpu` extra): cannot pin libtpu")


def tpu_devices(spec: TpuSpec, topology: str, slices: int) -> list:
    """Compile-only devices of `slices` slices of `spec.name:topology`, slice-major. Needs
    libtpu on this process's path and jax_platforms=cpu."""

    if jax.config.jax_platforms != "cpu":
        jax.config.update("jax_platforms", "cpu")
    chips = math.prod(int(p) for p in topology.split("x"))
    kwargs: dict = {"num_slices": slices} if slices > 1 else {}
    if chips < 4:  # libtpu's default host is 2x2x1 chips; smaller slices fit on one host
        kwargs["chips_per_host_bounds"] = [int(p) for p in (topology + "x1" * (3 - spec.dims)).split("x")]
    try:
        desc = topologies.get_topology_desc(topology_name=f"{spec.name}:{topology}", platform="tpu", **kwargs)
    except Exception as e:
        if "INVALID_ARGUMENT" not in str(e):  # not the shape: libtpu itself failed
            raise
        raise TopologyError(
            f"--topology: {spec.name}:{topology} x {slices} slice(s) is not a valid TPU "
            f"topology: {str(e).splitlines()[0]}"
        ) from None
    return sorted(desc.devices, key=lambda d: (getattr(d, "slice_index", 0), d.process_index, d.id))
