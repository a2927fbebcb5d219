"""XLA GPU flags for FSDP, chosen by what they change in the compiled schedule.

`GPU_FSDP_FLAGS` (config `xla_gpu_flags: fsdp`, `scripts/gpu_check.sh`) holds only the
flags that a deviceless XLA:GPU compile shows helping; `EVALUATED` lists every flag
looked at, with the evidence. Evidence: `configs/llama_1b.yaml` under full_shard compiled
for 8 x H100 (`scripts/inspect.py --target h100 --xla-flags=...`; table in
BENCHMARKS.md "XLA GPU flags in the compiled schedule"). Runtime speed still waits for a
GPU run. XLA reads XLA_FLAGS when the backend starts, so set them before the first JAX
computation; for one compile, `compile(compiler_options=parse_flags(...))`.
"""

from __future__ import annotations

import os
import subprocess
import sys

from fsdp_jax.errors import XlaFlagsError

# flag -> what the GPU compile showed (jax 0.10.2, 1B full_shard, 8 x H100)
EVALUATED: dict[str, str] = {
    "--xla_gpu_enable_while_loop_double_buffering=true": "kept: unrolls the layer loops by 2 so the next layer's gathers overlap this layer's "
    "matmuls (the largest forward gather has 11 GEMMs scheduled under it, vs 7), "
    "temp 4.47 vs 4.85 GB",
    "--xla_gpu_enable_latency_hiding_scheduler=true": "dropped: no change (already XLA:GPU's default; turning it off changed nothing either)",
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728": "dropped: merges each layer's 7 gathers into one 121 MB gather with no GEMM scheduled "
    "under it (was 1-7 per gather); fewer collectives (8 vs 15), temp -0.15 GB",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728": "dropped: with the one above",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728": "dropped: with the one above",
    "--xla_gpu_enable_pipelined_all_gather=true": "not adopted: peels the first layer's gathers out of the forward loop; overlap and "
    "temp nearly unchanged",
}

GPU_FSDP_FLAGS: tuple[str, ...] = tuple(f for f, why in EVALUATED.items() if why.startswith("kept"))


# XLA:GPU compile options every train step that shards params compiles with on GPUs
# (`step_compiler_options`; `jax.jit(compiler_options=...)`, so XLA_FLAGS need not name them).
# Evidence (deviceless XLA:GPU for H100, remat full; BENCHMARKS.md "Exposed collectives"):
# XLA 0.12's latency-hiding scheduler keeps one async collective in flight by default, so in
# full_shard's backward loop the next layer's re-gather and this layer's reduce-scatter compete
# for it: one gather per layer ran synchronously and one forward gather had nothing scheduled
# under it (Llama-2-7B on 8 x H100: 10.8% of the step's collective bytes exposed). hybrid_shard
# with f32 grad reductions (`fsdp_jax.sharding.precision.matmul`) ends each layer's backward with a chain
# of two collectives per weight (a reduce-scatter over `fsdp`, then an all-reduce of the shard
# over `data`): 14 for a Llama layer's 7 weights, more than a small limit holds (7B on 2 hosts
# x 4, jax 0.12: limit 2 9.95% exposed, 3 3.6%, 4 5.4%, 6 4.0%, 8 0%, 16 0%; jax 0.10: 2
# 9.9%, 8 0%). With 8 every collective of 7B and 70B full_shard and 7B hybrid_shard has compute
# under it on jax 0.10 and 0.12 (70B full_shard on 64 GPUs, jax 0.12: 1.44% at 2); peaks move
# by -5% (70B, jax 0.10) to +0.6% (7B full_shard, jax 0.12). With grads reduced in the compute
# dtype (`reduce=bfloat16`: plain bf16 dots, no barrier between them) XLA 0.12 combines a
# layer's weight-grad reduce-scatters into one issued at the end of the layer's backward with
# nothing left to put under it (7B full_shard: 2.57% exposed, 22.5 MB per layer, synchronous);
# a 1 MiB combine threshold keeps each weight's scatter apart, behind its own dot (0.48% on
# 0.12, 0% on 0.10; peak 20.86 -> 22.06 GB on 0.12). Grads reduced in f32 are not combined
# anyway (one barrier per weight grad), and their figures above hold with it (7B and 70B
# full_shard, 7B hybrid_shard: 0% exposed on 0.10 and 0.12).
STEP_OPTIONS_GPU: dict[str, int] = {
    "xla_gpu_experimental_parallel_collective_overlap_limit": 8,
    "xla_gpu_reduce_scatter_combine_threshold_bytes": 1 << 20,
}


def step_compiler_options(devices, shards_params: bool, environ=os.environ) -> dict[str, int] | None:
    """`STEP_OPTIONS_GPU` for a step on GPU `devices` (real or compile-only) whose strategy
    shards params, less any option the user's XLA_FLAGS sets (theirs win); None otherwise."""
    devices = list(devices)
    if not shards_params or not devices or devices[0].platform != "gpu":
        return None
    user = {f.lstrip("-").split("=")[0] for f in environ.get("XLA_FLAGS", "").split()}
    return {k: v for k, v in STEP_OPTIONS_GPU.items() if k not in user} or None


def apply_gpu_fsdp_flags(environ=os.environ) -> str:
    """Append GPU_FSDP_FLAGS to XLA_FLAGS (flags already set by the user win)."""
    current = environ.get("XLA_FLAGS", "")
    have = {f.split("=")[0] for f in current.split()}
    extra = [f for f in GPU_FSDP_FLAGS if f.split("=")[0] not in have]
    environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
    return environ["XLA_FLAGS"]


def parse_flags(text: str) -> dict[str, bool | int | float | str]:
    """'--xla_a=true --xla_b=123' -> {"xla_a": True, "xla_b": 123}: XLA flags as
    `compile(compiler_options=...)` takes them (bools and numbers typed: XLA rejects
    the string 'false' for a bool option). Raises ValueError naming the flag when one
    is not `--xla_name=value`."""
    out: dict[str, bool | int | float | str] = {}
    for tok in text.split():
        name, eq, value = tok.lstrip("-").partition("=")
        if not eq or not name.startswith("xla_") or not value:
            raise ValueError(f"--xla-flags: {tok!r} is not of the form --xla_<name>=<value>")
        out[name] = _typed(value)
    return out


def _typed(value: str) -> bool | int | float | str:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    for kind in (int, float):
        try:
            return kind(value)
        except ValueError:
            pass
    return value


# XLA's fatal log line for an XLA_FLAGS entry its build does not register
UNKNOWN_FLAG = "Unknown flag in XLA_FLAGS"


def unknown_flag(stderr: str) -> str | None:
    """The entry XLA refused, from the stderr of a process it aborted over XLA_FLAGS
    (`... parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --xla_nope=1`), else None."""
    for line in stderr.splitlines():
        if UNKNOWN_FLAG in line:
            return line.split(UNKNOWN_FLAG, 1)[1].lstrip(": ").strip()
    return None


_PROBE = "import jaxlib.xla_client as xc; xc.make_cpu_client()"
_probed: dict[str, str | None] = {}


def check_xla_flags(environ=os.environ) -> None:
    """Raise XlaFlagsError naming the entry of XLA_FLAGS this jaxlib's XLA does not know,
    before this process starts a backend (which would abort it with XLA's fatal log).
    A child process that starts only jaxlib's CPU client parses the flags (about 0.2 s,
    once per XLA_FLAGS value and process). Once this process's backends run, XLA has read
    the flags already and nothing is probed. Needs no JAX: a command checks before JAX loads
    (`fsdp_jax.app.cli.command.run_command`), so the refusal costs ~0.3 s of CPU, not ~2.5 s."""
    flags = environ.get("XLA_FLAGS", "").strip()
    if not flags:
        return
    bridge = sys.modules.get("jax._src.xla_bridge")  # a process that has not loaded JAX runs no backend
    if bridge is not None and bridge.backends_are_initialized():
        return
    if flags not in _probed:
        env = dict(environ, JAX_PLATFORMS="cpu")
        proc = subprocess.run([sys.executable, "-c", _PROBE], env=env, capture_output=True, text=True)
        _probed[flags] = unknown_flag(proc.stderr) if proc.returncode else None
    if _probed[flags]:
        raise XlaFlagsError(f"XLA_FLAGS: {UNKNOWN_FLAG}: {_probed[flags]} (this jax's XLA does not know it)")
