"""Throughput bookkeeping: peak FLOP/s per device kind, MFU, device memory."""

from __future__ import annotations

import time

import jax

from fsdp_jax.targets.perf_tables import device_kind_peaks

# jax's dtype names -> the keys of perf_tables.json's peaks (any other dtype: the bf16 peak)
DTYPE_KEYS = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def peak_flops(device: jax.Device, dtype: str = "bfloat16", override_tflops: float | None = None) -> float | None:
    """Peak FLOP/s of one device for `dtype`, or None when unknown (e.g. CPU): the dense
    peak of `perf_tables.json` (`device_kind_peaks`: datasheet figures, no sparsity)."""
    if override_tflops:
        return override_tflops * 1e12
    kind = device.device_kind.lower()
    for key, peaks in device_kind_peaks().items():
        if key in kind:
            return peaks.get(DTYPE_KEYS.get(dtype, "bf16"), peaks["bf16"])
    return None


def mfu(flops_per_token: float, tokens_per_s: float, n_devices: int, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' peak."""
    if not peak:
        return None
    return flops_per_token * tokens_per_s / (peak * n_devices)


def device_memory() -> dict[str, int] | None:
    """`memory_stats()` of this process's devices, where the backend reports it (GPU,
    TPU): bytes in use, peak bytes in use and the limit, each the largest over the
    local devices (FSDP balances them; the fullest one is the one that runs out).
    None on CPU, which reports nothing (use the compiled peak there)."""
    stats = [d.memory_stats() for d in jax.local_devices()]
    stats = [s for s in stats if s]
    if not stats:
        return None
    return {k: max(int(s.get(k, 0)) for s in stats) for k in ("bytes_in_use", "peak_bytes_in_use", "bytes_limit")}


def memory_excess(measured_peak: int, estimate: int, tolerance: float = 0.10) -> str | None:
    """A warning when the measured per-device peak exceeds the `estimate` (the compiled
    step's memory_analysis peak) by more than `tolerance`; else None."""
    if not estimate or measured_peak <= estimate * (1 + tolerance):
        return None
    return (
        f"measured device memory peak {measured_peak / 2**20:.1f} MiB exceeds the compiled "
        f"estimate {estimate / 2**20:.1f} MiB by {measured_peak / estimate - 1:.0%} "
        f"(> {tolerance:.0%}): something outside the train step holds device memory "
        f"(eval, batches in flight, fragmentation); leave headroom when planning"
    )


def time_steps(step_fn, state, batch, steps: int, warmup: int):
    """Run `warmup` then `steps` calls of `state, metrics = step_fn(state, batch)`,
    blocking on each step's metrics; returns (state, last metrics, per-step wall seconds)."""
    for _ in range(warmup):
        state, m = step_fn(state, batch)
        jax.block_until_ready(m)
    times, m = [], None
    for _ in range(steps):
        t = time.perf_counter()
        state, m = step_fn(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t)
    return state, m, times
