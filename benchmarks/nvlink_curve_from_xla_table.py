"""The NVLink latency and bus bandwidth of the step-time table (`h100.links.fast` in
`fsdp_jax/targets/perf_tables.json`), fitted to the collective timings XLA ships for H100.

    python benchmarks/nvlink_curve_from_xla_table.py            # needs `python -m fsdp_jax.targets install cuda`

XLA:GPU carries a measured collective performance table (openxla/xla
`xla/service/gpu/model/default_collective_perf_table.txtpb`, made by `collective_perf_table_gen`
on the GPUs named by each key) and compiles it into the CUDA plugin; this reads it from the
plugin jax 0.10.2 installs here (jax-v0.10.2 pins openxla/xla 5a9e73cbd92530cac2ac36f4736a774b2412afe2).
For the `sm_90` (H100) key, one group of 8 GPUs: each entry's time is its tensor bytes (an
all-gather's output, a reduce-scatter's input: the full buffer) over its
`network_throughput_bytes_per_sec`; its wire bytes per GPU are (n-1)/n of the full buffer, as the
op walk counts them (`fsdp_jax.hlo.schedule.wire_bytes`). The model's curve is
time = latency + wire / busbw; latency and 1/busbw are fitted by linear least squares on the
relative error, all-gathers and reduce-scatters of 1 KiB-2 GiB together. Prints the fit, the
residual per point, and the same fit for the all-reduces (2(n-1)/n wire) for comparison.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

N = 8


def plugin_table() -> str:
    """The collective table's text, as compiled into the installed CUDA plugin."""
    from fsdp_jax.targets.plugins import plugin_dir

    sos = sorted(Path(plugin_dir()).glob("jax_plugins/*/xla_cuda_plugin.so"))
    if not sos:
        raise SystemExit("no CUDA plugin: run `python -m fsdp_jax.targets install cuda` first")
    blob = sos[0].read_bytes()
    i = blob.find(b"network_throughput_bytes_per_sec:")
    if i < 0:
        raise SystemExit(f"{sos[0]}: no collective performance table in this plugin")
    return blob[blob.rfind(b"\x00", 0, i) + 1 : blob.find(b"\x00", i)].decode()


def sm90_points(table: str) -> dict[str, list[tuple[int, float, float]]]:
    """{opcode: [(full buffer bytes, wire bytes per GPU, seconds)]} for one group of 8 on sm_90."""
    keys = [(m.start(), m.group(1)) for m in re.finditer(r'\n  entries \{\n    key: "([^"]+)"', table)]
    starts = [s for s, k in keys if k == "sm_90"]
    if not starts:
        raise SystemExit("the plugin's table has no sm_90 entry")
    end = min([s for s, _ in keys if s > starts[0]], default=len(table))
    pts: dict[str, list[tuple[int, float, float]]] = {}
    for blk in re.split(r"\n      entries \{", table[starts[0] : end])[1:]:
        groups = re.search(r"num_replica_groups: (\d+)\s+num_devices_per_group: (\d+)", blk)
        if not groups or (int(groups.group(1)), int(groups.group(2))) != (1, N):
            continue
        op = re.search(r'opcode: "([^"]+)"', blk).group(1)
        dim = int(re.search(r"dimensions: (\d+)", blk).group(1))
        elem = {"F32": 4, "BF16": 2, "F16": 2}[re.search(r"element_type: (\w+)", blk).group(1)]
        thr = float(re.search(r"network_throughput_bytes_per_sec: (\d+)", blk).group(1))
        full = dim * elem * (N if op == "reduce-scatter" else 1)
        wire = full * (N - 1) / N * (2 if op == "all-reduce" else 1)
        pts.setdefault(op, []).append((full, wire, full / thr))
    return {op: sorted(p) for op, p in pts.items()}


def fit(points: list[tuple[int, float, float]]) -> tuple[float, float]:
    """(latency s, bus bytes/s) minimizing sum((latency + wire / busbw) / t - 1)^2."""
    t = np.array([p[2] for p in points])
    w = np.array([p[1] for p in points])
    (lat, inv_bw), *_ = np.linalg.lstsq(np.stack([1 / t, w / t], axis=1), np.ones_like(t), rcond=None)
    return float(lat), float(1 / inv_bw)


def main() -> int:
    pts = sm90_points(plugin_table())
    lat, bw = fit(pts["all-gather"] + pts["reduce-scatter"])
    print(
        f"all-gather + reduce-scatter, 8 x H100 (XLA sm_90 table): latency {lat * 1e6:.1f} us, busbw {bw / 1e9:.1f} GB/s"
    )
    for op in ("all-gather", "reduce-scatter", "all-reduce"):
        res = " ".join(f"{f >> 10}K:{(lat + w / bw) / s - 1:+.0%}" for f, w, s in pts[op])
        print(f"  {op} (model / measured - 1, by full buffer): {res}")
    lat_ar, bw_ar = fit(pts["all-reduce"])
    print(f"all-reduce alone (2(n-1)/n wire): latency {lat_ar * 1e6:.1f} us, busbw {bw_ar / 1e9:.1f} GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
