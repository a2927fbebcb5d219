"""XLA GPU flags that help FSDP overlap communication with compute.

They are opt-in (config `xla_gpu_flags: fsdp` / `scripts/gpu_check.sh` measures
them) and become defaults only once measured on a GPU (BENCHMARKS.md). XLA reads
XLA_FLAGS when the backend starts, so set them before the first JAX computation.
"""

from __future__ import annotations

import os

GPU_FSDP_FLAGS: tuple[str, ...] = (
    # schedule collectives to overlap with independent compute
    "--xla_gpu_enable_latency_hiding_scheduler=true",
    # combine small per-leaf collectives into fewer, larger ones (bytes)
    "--xla_gpu_all_gather_combine_threshold_bytes=134217728",
    "--xla_gpu_reduce_scatter_combine_threshold_bytes=134217728",
    "--xla_gpu_all_reduce_combine_threshold_bytes=134217728",
    # prefetch the next layer's all-gather inside the scanned layer loop
    "--xla_gpu_enable_while_loop_double_buffering=true",
)


def apply_gpu_fsdp_flags(environ=os.environ) -> str:
    """Append GPU_FSDP_FLAGS to XLA_FLAGS (flags already set by the user win)."""
    current = environ.get("XLA_FLAGS", "")
    have = {f.split("=")[0] for f in current.split()}
    extra = [f for f in GPU_FSDP_FLAGS if f.split("=")[0] not in have]
    environ["XLA_FLAGS"] = " ".join([current, *extra]).strip()
    return environ["XLA_FLAGS"]


def parse_flags(text: str) -> dict[str, str]:
    """'--xla_a=true --xla_b=123' -> {"xla_a": "true", "xla_b": "123"} (compile options).
    Raises ValueError naming the flag when one is not `--xla_name=value`."""
    out = {}
    for tok in text.split():
        name, eq, value = tok.lstrip("-").partition("=")
        if not eq or not name.startswith("xla_") or not value:
            raise ValueError(f"--xla-flags: {tok!r} is not of the form --xla_<name>=<value>")
        out[name] = value
    return out
