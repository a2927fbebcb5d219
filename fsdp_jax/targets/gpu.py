"""Compile for a real GPU cluster or TPU slice on a machine without one (deviceless AOT).

    python -m fsdp_jax.targets install            # once: the CUDA compile-only plugin
    python -m fsdp_jax.targets install tpu        # once: libtpu, for TPU targets (fsdp_jax.targets.tpu)
    env = targets.child_env()                     # for a child process that compiles
    # in that child (the plugin on its path, jax_platforms=cpu):
    devices = targets.gpu_devices("h100", hosts=2, gpus_per_host=4)
    mesh = fsdp_jax.make_mesh(data=2, fsdp=4, devices=devices)
    compiled = jax.jit(step).lower(*abstract_args).compile()   # XLA:GPU, sm_90

Targets are data: `fsdp_jax/targets/gpu_targets/<name>.txtpb`, a text
`stream_executor.GpuTargetConfigProto` written from the chip's public specification
(SM count, clocks, memory size and bandwidth, L2, shared memory, compute
capability). `jax.experimental.topologies.get_topology_desc(platform="cuda", ...)`
turns one into `hosts x gpus_per_host` compile-only devices; a `Mesh` of them and
`jit(...).lower(<ShapeDtypeStructs with shardings>).compile()` run the full XLA:GPU
pipeline, with real `memory_analysis()` and the scheduled GPU HLO.

Why a private folder: JAX imports every installed PJRT plugin at start-up, and the
CUDA plugin, on a machine without a GPU, prints absl warnings to stderr on every
`import jax`, even with `JAX_PLATFORMS=cpu`. So the plugin is installed with
`pip install --target` into `plugin_dir()` (outside site-packages), and only the
processes that compile for a GPU target put that folder on their path
(`child_env()`); normal CPU runs never see it. TPU targets (`v4`, `v5e`, `v5p`, `v6e`, or
`v5p-64`-style accelerator types; several slices over the data-center network) go the
same road with libtpu in a folder of its own (`plugin_dir("tpu")`): one `Target`, one
`child_env(target=...)`, one `target_devices(target)`.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from dataclasses import dataclass
from pathlib import Path

import jax
from jax.experimental import topologies

from fsdp_jax.errors import MissingExtra, TargetError
from fsdp_jax.targets import clusters, tpu
from fsdp_jax.targets.plugins import (
    KINDS,
    install,
    installed_jax_version,
    missing_message,
    plugin_dir,
    plugin_installed,
)
from fsdp_jax.targets.tpu_flags import merge_init_args

_DATA = Path(__file__).resolve().parent / "gpu_targets"


@dataclass(frozen=True)
class Target:
    """A named accelerator and the cluster shape to compile for.

    GPU (`h100`, ...): `hosts` x `gpus_per_host` GPUs. TPU (`v5p`, ...): `hosts` slices
    over the data-center network, each `topology_name` (e.g. "2x4x4") with
    `gpus_per_host` devices; the hosts within a slice come from libtpu's topology. Either
    way `hosts` counts the groups the slow network joins: hybrid_shard puts `data` across
    them and `fsdp` within one. `libtpu_args`: TPU only, flags for the compiling child's
    LIBTPU_INIT_ARGS, under the user's own (`fsdp_jax.targets.tpu_flags`)."""

    name: str
    hosts: int = 1
    gpus_per_host: int = 8
    topology_name: str | None = None
    libtpu_args: str = ""
    cluster: str | None = None  # a rented cluster (`fsdp_jax.targets.clusters`): its network costs the plan

    @property
    def table(self) -> str:
        """The key of perf_tables.json that costs this target: the cluster's, else the device's."""
        return clusters.clusters()[self.cluster]["table"] if self.cluster else self.name

    @property
    def platform(self) -> str:
        return "tpu" if self.topology_name else "gpu"

    @property
    def devices(self) -> int:
        return self.hosts * self.gpus_per_host

    @property
    def topology(self) -> str:
        """get_topology_desc's shape: GPU `1 x hosts x per host`; TPU `gen:AxB[xC]` per slice."""
        if self.topology_name:
            return f"{self.name}:{self.topology_name}"
        return f"1x{self.hosts}x{self.gpus_per_host}"

    def describe(self) -> str:
        if self.topology_name:
            return (
                f"{self.name} ({device_name(self.name)}), {self.hosts} slice(s) of {self.topology_name} "
                f"({self.gpus_per_host} devices each)"
            )
        where = f" on {self.cluster}" if self.cluster else ""
        return f"{self.name} ({device_name(self.name)}), {self.hosts} x {self.gpus_per_host} GPUs{where}"

    def as_dict(self) -> dict:
        return {
            "name": self.name,
            "hosts": self.hosts,
            "gpus_per_host": self.gpus_per_host,
            "topology_name": self.topology_name,
            "libtpu_args": self.libtpu_args,
            "cluster": self.cluster,
        }


def target_names(platform: str | None = None) -> list[str]:
    """Names of the shipped targets: the GPUs a100, h100, h200, the PCIe cards a10g, l4, l40s,
    rtx3090, rtx4090 (files in fsdp_jax/targets/gpu_targets) and the TPU generations v4, v5e, v5p, v6e; `platform` "gpu" or
    "tpu" keeps one kind."""
    gpus = sorted(p.stem for p in _DATA.glob("*.txtpb"))
    return {"gpu": gpus, "tpu": list(tpu.TPU_SPECS)}.get(platform, gpus + list(tpu.TPU_SPECS))


def target_config(name: str) -> str:
    """The text GpuTargetConfigProto of GPU target `name`."""
    path = _DATA / f"{name}.txtpb"
    if name not in target_names("gpu"):
        raise TargetError(f"--target: unknown GPU target {name!r}; known: {', '.join(target_names())}")
    return path.read_text()


def _tpu_spec(name: str) -> tpu.TpuSpec:
    try:
        return tpu.split_name(name)[0]
    except tpu.TopologyError as e:
        raise TargetError(str(e)) from None


def device_name(name: str) -> str:
    """The device description of target `name` (e.g. 'NVIDIA H100 80GB HBM3 (SXM5)', 'TPU v5')."""
    if tpu.is_tpu(name):
        return _tpu_spec(name).device_kind
    for line in target_config(name).splitlines():
        if line.strip().startswith("device_description_str:"):
            return line.split(":", 1)[1].strip().strip('"')
    return name


def device_memory(name: str) -> int:
    """Bytes of memory per device of target `name`: a GPU target's `device_memory_size`, a
    TPU's published HBM per chip over the devices libtpu makes of one chip."""
    if tpu.is_tpu(name):
        spec = _tpu_spec(name)
        return spec.hbm_bytes // spec.devices_per_chip
    for line in target_config(name).splitlines():
        if line.strip().startswith("device_memory_size:"):
            return int(line.split(":", 1)[1])
    raise TargetError(f"GPU target {name!r} has no device_memory_size")


def _positive(**flags) -> None:
    for flag, v in flags.items():
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise TargetError(f"--{flag.replace('_', '-')}: {v!r} must be a positive integer")


def make_tpu_target(
    name: str, devices: int | None = None, slices: int | None = None, topology: str | None = None
) -> Target:
    """A TPU target: `name` a generation (`v5p`) or accelerator type (`v5p-64`, one slice's
    size); `devices` chips in total over `slices` (default 1), or one slice's `topology`."""
    _positive(devices=devices, slices=slices)
    slices = slices or 1
    try:
        spec, typed_chips = tpu.split_name(name)
        if topology is not None:
            topo, chips = tpu.parse_topology(spec, topology)
        else:
            if typed_chips is None and devices is None:
                raise TargetError(
                    "--devices: give the number of TPU chips (or --topology, or an accelerator type such as v5p-64)"
                )
            if typed_chips is not None:
                chips = typed_chips
            else:
                if devices % (slices * spec.devices_per_chip):
                    raise TargetError(
                        f"--slices: {devices} devices do not divide into {slices} slices of whole {spec.name} chips"
                    )
                chips = devices // slices // spec.devices_per_chip
            topo = tpu.default_topology(spec, chips)
        per_slice = chips * spec.devices_per_chip
        if devices is not None and devices != per_slice * slices:
            raise TargetError(
                f"--devices: {devices} is not {slices} slice(s) x {per_slice} devices of {spec.name}:{topo}"
            )
    except tpu.TopologyError as e:
        raise TargetError(str(e)) from None
    return Target(spec.name, slices, per_slice, topo)


def make_target(
    name: str,
    devices: int | None = None,
    hosts: int | None = None,
    gpus_per_host: int | None = None,
    *,
    slices: int | None = None,
    topology: str | None = None,
) -> Target:
    """Validate a target request. GPU: `devices` in total over `hosts` (default 1), or
    `hosts` x `gpus_per_host`. TPU (`make_tpu_target`): `devices` over `slices`, or a
    `topology`. Raises TargetError naming the flag and the value."""
    if tpu.is_tpu(name):
        if hosts is not None or gpus_per_host is not None:
            raise TargetError(
                f"--hosts: a TPU target's hosts come from its topology; use --slices for several {name} slices"
            )
        return make_tpu_target(name, devices, slices, topology)
    if slices is not None or topology is not None:
        raise TargetError(
            f"--{'slices' if slices is not None else 'topology'}: only for TPU targets "
            f"({', '.join(tpu.TPU_SPECS)}); {name} uses --hosts"
        )
    name, gpus_per_host, cluster = clusters.resolve(name, gpus_per_host)
    target_config(name)
    _positive(devices=devices, hosts=hosts, gpus_per_host=gpus_per_host)
    hosts = hosts or 1
    if gpus_per_host is None:
        if devices is None:
            raise TargetError("--devices: give the total number of GPUs (or --gpus-per-host)")
        if devices % hosts:
            raise TargetError(
                f"--hosts: {devices} devices do not divide into {hosts} hosts; make --devices a multiple of --hosts"
            )
        gpus_per_host = devices // hosts
    elif devices is not None and devices != hosts * gpus_per_host:
        raise TargetError(
            f"--devices: {devices} is not --hosts ({hosts}) x --gpus-per-host "
            f"({gpus_per_host}) = {hosts * gpus_per_host}"
        )
    return Target(name, hosts, gpus_per_host, cluster=cluster)


KERNEL_CACHE_FLAG = "--xla_gpu_kernel_cache_file"


def child_env(
    env: dict[str, str] | None = None, kernel_cache: str | os.PathLike | None = None, target: Target | None = None
) -> dict[str, str]:
    """Environment for a child process that compiles for `target` (default: GPU targets):
    the plugin folder first on PYTHONPATH and JAX_PLATFORMS=cpu (without it the CUDA
    plugin calls cuInit and fails). Raises MissingExtra when the plugin is not installed.
    For a TPU target: libtpu's folder, TPU_WORKER_HOSTNAMES=localhost (else libtpu logs
    an error about it), ALLOW_MULTIPLE_LIBTPU_LOAD=1 and the target's `libtpu_args` in
    LIBTPU_INIT_ARGS (the user's flags win); `kernel_cache` is GPU-only and ignored.

    `kernel_cache`: a file, new or written only by that child, for XLA:GPU's compiled
    kernel cache (XLA_FLAGS `--xla_gpu_kernel_cache_file`, unless XLA_FLAGS names one
    already). Compiling one model under several strategies, later compiles reuse the
    earlier ones' kernels (most of a small step's compile is building its ~140 kernels),
    with the same optimized HLO. Never share the file between processes that run at the
    same time: a damaged cache file makes every later compile fail. A file XLA_FLAGS names
    must be in an existing, writable directory (TargetError otherwise, before any compile);
    an empty value (`--xla_gpu_kernel_cache_file=`) turns the cache off."""
    if target is not None and target.platform == "tpu":
        if not plugin_installed(kind="tpu"):
            raise MissingExtra(missing_message("tpu"))
        env = dict(os.environ if env is None else env)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_dir(kind="tpu")), env.get("PYTHONPATH")) if p)
        env["JAX_PLATFORMS"] = "cpu"
        env.setdefault("TPU_WORKER_HOSTNAMES", "localhost")
        # compile-only: no chip to guard, so several compiling processes (test workers, two
        # planners) may load libtpu at once instead of failing on /tmp/libtpu_lockfile
        env.setdefault("ALLOW_MULTIPLE_LIBTPU_LOAD", "1")
        if target.libtpu_args:
            env["LIBTPU_INIT_ARGS"] = merge_init_args(target.libtpu_args, env.get("LIBTPU_INIT_ARGS", ""))
        return env
    if not plugin_installed():
        raise MissingExtra(missing_message())
    env = dict(os.environ if env is None else env)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(plugin_dir()), env.get("PYTHONPATH")) if p)
    env["JAX_PLATFORMS"] = "cpu"
    flags = env.get("XLA_FLAGS", "")
    named = [f.split("=", 1)[1] for f in flags.split() if f.startswith(KERNEL_CACHE_FLAG + "=")]
    if named:
        folder = Path(named[-1]).absolute().parent
        if named[-1] and not (folder.is_dir() and os.access(folder, os.W_OK)):
            raise TargetError(
                f"XLA_FLAGS {KERNEL_CACHE_FLAG}={named[-1]}: its directory {folder} "
                "does not exist or is not writable (an empty value turns the cache off)"
            )
    elif kernel_cache is not None:
        env["XLA_FLAGS"] = f"{flags} {KERNEL_CACHE_FLAG}={os.fspath(kernel_cache)}".strip()
    return env


def enable_in_process() -> None:
    """Put the plugin on this process's path (before JAX initialises its backends) and
    restrict JAX to the CPU platform, so `gpu_devices` works here. Prefer a child
    process (`child_env`): once enabled, this process prints the plugin's warnings."""
    if not plugin_installed():
        raise MissingExtra(missing_message())
    if str(plugin_dir()) not in sys.path:
        sys.path.insert(0, str(plugin_dir()))

    jax.config.update("jax_platforms", "cpu")


def gpu_devices(name: str, hosts: int = 1, gpus_per_host: int = 8) -> list:
    """`hosts x gpus_per_host` compile-only devices of GPU target `name`, host-major
    (device i is on host i // gpus_per_host; `process_index` says which). Needs the
    plugin on this process's path (`child_env` / `enable_in_process`) and
    jax_platforms=cpu. The devices compile but cannot run anything (no device_put)."""
    t = make_target(name, hosts=hosts, gpus_per_host=gpus_per_host)
    if importlib.util.find_spec("jax_plugins.xla_cuda12") is None:
        raise MissingExtra(
            missing_message() + " (and run in a process from "
            "fsdp_jax.targets.gpu.child_env(), or call enable_in_process() first)"
        )

    if jax.config.jax_platforms != "cpu":
        jax.config.update("jax_platforms", "cpu")  # else the plugin calls cuInit and fails
    topo = topologies.get_topology_desc(platform="cuda", target_config=target_config(t.name), topology=t.topology)
    devices = sorted(topo.devices, key=lambda d: (d.process_index, d.id))
    if len(devices) != t.devices:
        raise RuntimeError(f"topology {t.topology} gave {len(devices)} devices, expected {t.devices}")
    return devices


def target_devices(target: Target) -> list:
    """Compile-only devices of `target`, host-major (GPU) or slice-major (TPU), in a process
    from `child_env(target=target)`. Raises TargetError for a TPU topology libtpu rejects."""
    if target.platform == "gpu":
        return gpu_devices(target.name, target.hosts, target.gpus_per_host)
    if importlib.util.find_spec("libtpu") is None:
        raise MissingExtra(
            missing_message("tpu") + " (and run in a process from fsdp_jax.targets.gpu.child_env(target=...))"
        )
    spec = _tpu_spec(target.name)
    try:
        devices = tpu.tpu_devices(spec, target.topology_name, target.hosts)
    except tpu.TopologyError as e:
        raise TargetError(str(e)) from None
    if len(devices) != target.devices:
        raise TargetError(
            f"--topology: {target.topology} x {target.hosts} slice(s) gave {len(devices)} "
            f"devices, expected {target.devices}"
        )
    return devices


def dcn_groups(devices) -> list[int]:
    """Per device, the group the slow network joins: its host (GPU: NVLink within a host)
    or its slice (TPU: ICI within a slice, the data-center network between slices)."""
    if devices and devices[0].platform == "tpu":
        return [getattr(d, "slice_index", 0) for d in devices]
    return [d.process_index for d in devices]


# ----------------------------------------------------------------------------- CLI


def main(argv: list[str] | None = None) -> int:
    """`python -m fsdp_jax.targets install [cuda|tpu|all] | check [cuda|tpu] | list`."""
    argv = sys.argv[1:] if argv is None else argv
    cmd = argv[0] if argv else "check"
    if cmd == "list":
        for n in target_names():
            print(f"{n}: {device_name(n)}, {device_memory(n) / 2**30:.1f} GiB per device")
        return 0
    if cmd not in ("install", "check") or len(argv) > 2:
        print(
            f"error: unknown command {' '.join(argv)!r}; use install [cuda|tpu|all], check [cuda|tpu] or list",
            file=sys.stderr,
        )
        return 2
    which = argv[1] if len(argv) > 1 else "cuda"
    kinds = KINDS if which == "all" and cmd == "install" else (which,)
    if any(k not in KINDS for k in kinds):
        print(f"error: {cmd} {which!r}: choose cuda, tpu" + (" or all" if cmd == "install" else ""), file=sys.stderr)
        return 2
    for kind in kinds:
        if cmd == "install":
            try:
                path = install(kind=kind)
            except RuntimeError as e:
                print(f"error: {e}", file=sys.stderr)
                return 1
            print(
                f"{'libtpu' if kind == 'tpu' else 'CUDA compile-only plugin'} for jaxlib {installed_jax_version()}: {path}"
            )
        elif plugin_installed(kind=kind):
            print(f"installed: {plugin_dir(kind=kind)}")
        else:
            print(f"error: {missing_message(kind)}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
