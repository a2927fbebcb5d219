"""Seconds for each op of a compiled program on a target, and the schedule they run in.

    ops = fsdp_jax.hlo.costs.op_inventory(hlo_text, hosts)      # target-free: FLOPs, bytes, messages
    sim = simulate(ops, perf_table("h100"))                     # {"step_s", "breakdown", "ops"}

Costs (constants from `fsdp_jax/targets/perf_tables.json`, each with its source):
- a GEMM: max(FLOPs / (peak[dtype] x `gemm_efficiency`), bytes / HBM) + a launch gap, where
  `gemm_efficiency` = the table's `gemm.max_efficiency` x wave quantization x MXU fill. Wave
  quantization (GPU): the output tiles over the SMs' full waves (a 128 x 256 tile per SM on
  H100), so a GEMM whose grid leaves SMs idle in its last wave runs slower. MXU fill (TPU):
  the weight operand (K x N) is padded to the systolic array's width in both dims (128, or
  256 on v6e), so a dim of 128 on a 256-wide MXU fills half of it;
- cuDNN flash attention: its FLOPs at the published forward / backward throughput for its
  sequence length (interpolated in log(seq)); on a table without attention figures (TPU: a
  Pallas splash kernel), its FLOPs at the GEMM rate x the MXU fill of its head dim (every
  matmul of the kernel has the head dim as its contraction or as its weight operand's other
  dim; no splash throughput is published);
- any other fusion or data op: its bytes at HBM bandwidth x efficiency, + the launch gap;
- a collective: latency + wire bytes / bus bandwidth of its link (within a host: NVLink, or
  ICI within a TPU slice; across hosts: the NIC, or DCN across slices), the wire bytes of a
  ring over its group (`fsdp_jax.hlo.schedule.wire_bytes`);
- a host transfer: bytes over the host link (PCIe).

The schedule: one compute stream runs the kernels in the compiled order; collectives run
one at a time on a communication stream (host copies on a host stream). An async
collective starts when the compute stream reaches its start (and the link is free); its
done waits for it: only the compute scheduled between start and done hides it, the rest
stalls the compute stream and counts as exposed communication of its kind. A synchronous
collective stalls for all of it. A while loop costs its trip count times its body (each
iteration drains its collectives before the next).
"""

from __future__ import annotations

import math
from collections import defaultdict
from typing import Any

from fsdp_jax.hlo.schedule import wire_bytes

CATEGORIES = ("gemm", "attention", "memory", "update", "host", "exposed_comm")


def _interp_log(x: float, xs: list[float], ys: list[float]) -> float:
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    for (x0, y0), (x1, y1) in zip(zip(xs, ys), zip(xs[1:], ys[1:])):
        if x0 <= x <= x1:
            f = (math.log(x) - math.log(x0)) / (math.log(x1) - math.log(x0))
            return y0 + f * (y1 - y0)
    return ys[-1]


def wave_efficiency(m: int, n: int, batch: int, gemm: dict[str, Any]) -> float:
    """The fraction of SM-waves a GEMM's output tiles fill (1.0 where the table has no SM count)."""
    if not gemm.get("sms"):
        return 1.0
    tiles = math.ceil(m / gemm["tile_m"]) * math.ceil(n / gemm["tile_n"]) * batch
    waves = math.ceil(tiles / gemm["sms"])
    return tiles / (waves * gemm["sms"])


def mxu_fill(dim: int, gemm: dict[str, Any]) -> float:
    """The fraction of the MXU's width a matmul dim of `dim` fills once padded to it (1.0
    where the table has no MXU width: GPUs)."""
    w = gemm.get("mxu")
    return dim / (math.ceil(dim / w) * w) if w else 1.0


def shape_efficiency(op: dict[str, Any], g: dict[str, Any]) -> float:
    """The efficiency of a GEMM of `op`'s (m, n, k) before wave and MXU fill, by one rule on
    every target (docs/step_time.md, "GEMM efficiency by shape"): the point of the chip's
    published matmul curve (`gemm.curve.points`, [m, n, k, efficiency]) nearest in
    |log m| + |log n| + |log k| (a tie: the lower efficiency); a chip with no published
    curve takes its one `gemm.max_efficiency` (fitted, and reported as fitted)."""
    points = (g.get("curve") or {}).get("points")
    if not points:
        return g["max_efficiency"]
    dims = [max(op[d], 1) for d in ("m", "n", "k")]
    return min(points, key=lambda p: (sum(abs(math.log(a / b)) for a, b in zip(p[:3], dims)), p[3]))[3]


def gemm_efficiency(op: dict[str, Any], t: dict[str, Any]) -> float:
    """The fraction of the peak a GEMM record `op` (m, n, k, batch) runs at on table `t` when
    compute-bound: `shape_efficiency` x wave quantization x the MXU fill of K and N."""
    g = t["gemm"]
    fill = mxu_fill(op["k"], g) * mxu_fill(op["n"], g)
    return shape_efficiency(op, g) * wave_efficiency(op["m"], op["n"], op["batch"], g) * fill


# Publishers count model FLOPs differently (attention's share, the head): the same run is
# 65.4% MFU in MaxText's count (the v5p record, `best_mfu`) and 67.0% in ours (PaLM's count,
# published row 5 predicted at its published tokens/s). A prediction is flagged once it is
# above the record by more than such a difference of counts.
MFU_COUNT_SLACK = 0.05


def above_best_mfu(mfu: float, t: dict[str, Any]) -> str | None:
    """A warning when a predicted MFU exceeds the best ever published for the chip
    (`best_mfu` of the table, with its source) by more than `MFU_COUNT_SLACK`, else None:
    such a prediction is more likely the model's error than the run's."""
    best = t.get("best_mfu")
    if not best or mfu <= best["mfu"] * (1 + MFU_COUNT_SLACK):
        return None
    return f"predicted MFU {mfu:.1%} is above the best published for this chip, {best['mfu']:.1%} ({best['source']})"


def _hbm(t: dict[str, Any]) -> float:
    return t["hbm"]["bytes_per_s"] * t["hbm"]["efficiency"]


def op_seconds(op: dict[str, Any], t: dict[str, Any]) -> float:
    """Seconds one execution of inventory record `op` takes on target table `t`."""
    kind, launch = op["kind"], t["hbm"]["launch_s"]
    if kind == "gemm":
        peaks = t["peak_flops"]
        peak = peaks.get(op["dtype"], peaks["bf16"])
        return max(op["flops"] / (peak * gemm_efficiency(op, t)), op["bytes"] / _hbm(t)) + launch
    if kind == "attention":
        a = t.get("attention")
        if not a and op.get("kernel") == "splash":  # the MXU at the GEMM rate (module docstring)
            eff = t["gemm"]["max_efficiency"] * mxu_fill(op["d"], t["gemm"])
            return op["flops"] / (t["peak_flops"]["bf16"] * eff) + launch
        if not a:
            raise ValueError(f"no attention throughput for this target (a {op['direction']} custom call)")
        thr = _interp_log(op["sq"], a["seq"], a["fwd_flops" if op["direction"] == "fwd" else "bwd_flops"])
        return op["flops"] / thr + launch
    if kind == "memory":
        return op["bytes"] / _hbm(t) + launch
    if kind == "host":
        return op["bytes"] / t["host"]["bytes_per_s"]
    if kind == "collective":
        return collective_seconds(op, t)
    return 0.0


def collective_seconds(op: dict[str, Any], t: dict[str, Any]) -> float:
    """latency + ring wire bytes / bus bandwidth of the collective's link (one execution)."""
    wire = wire_bytes({**op, "bytes_per_step": op["bytes"]})
    if not wire:
        return 0.0
    link = t["links"]["slow" if op.get("crosses_hosts") else "fast"]
    if not link.get("bus_bytes_per_s"):
        raise ValueError("a collective crosses a network whose bandwidth is unpublished for this target")
    return link["latency_s"] + wire / link["bus_bytes_per_s"]


def category(op: dict[str, Any]) -> str:
    """Which line of the breakdown a compute op's time goes to: `update` for work outside
    the model's forward and backward (the optimizer update, gradient clipping)."""
    if op["kind"] == "memory" and not any(s in op["op_name"] for s in ("jvp(", "transpose(")):
        return "update"
    return op["kind"]


class _Stream:
    """One computation's timeline: the compute clock and each link's free time."""

    def __init__(self):
        self.clock = 0.0
        self.free: dict[str, float] = defaultdict(float)
        self.waits: list[tuple[int | None, float, str]] = []
        self.spent: dict[str, float] = defaultdict(float)

    def wait(self, finish: float, what: str) -> None:
        if finish > self.clock:
            self.spent[what] += finish - self.clock
            self.clock = finish

    def settle(self, upto: int | None) -> None:
        """Wait for the transfers whose done is scheduled before position `upto` (all: None)."""
        keep = []
        for done, finish, what in self.waits:
            if upto is None or (done is not None and done < upto):
                self.wait(finish, what)
            else:
                keep.append((done, finish, what))
        self.waits = keep


def simulate(ops: list[dict[str, Any]], t: dict[str, Any]) -> dict[str, Any]:
    """The predicted step: {"step_s", "breakdown" (seconds per CATEGORIES line, exposed
    communication also by kind as "exposed <op>"), "ops" (each costed record with `s` per
    execution and `total_s` per step)}."""
    by_comp: dict[str, list[dict[str, Any]]] = defaultdict(list)
    costed = []
    for op in ops:
        c = {**op, "s": op_seconds(op, t)}
        c["total_s"] = c["s"] * c["runs"]
        costed.append(c)
        by_comp[op["computation"]].append(c)
    bodies = {op["body"] for op in ops if op["kind"] == "loop"}
    bodies |= {b for op in ops if op["kind"] == "conditional" for b in op["branches"]}
    memo: dict[str, tuple[float, dict[str, float]]] = {}

    def run(comp: str) -> tuple[float, dict[str, float]]:
        if comp in memo:
            return memo[comp]
        st = _Stream()
        for op in sorted(by_comp.get(comp, ()), key=lambda o: o["pos"]):
            st.settle(op["pos"])
            if op["kind"] == "loop":
                s, spent = run(op["body"]) if op["body"] else (0.0, {})
                st.clock += op["trip_count"] * s
                for k, v in spent.items():
                    st.spent[k] += op["trip_count"] * v
            elif op["kind"] == "conditional":  # one branch runs: count the longest
                s, spent = max((run(b) for b in op["branches"]), key=lambda r: r[0], default=(0.0, {}))
                st.clock += s
                for k, v in spent.items():
                    st.spent[k] += v
            elif op["kind"] in ("collective", "host"):
                link = "host" if op["kind"] == "host" else "comm"
                start = max(st.clock, st.free[link])
                st.free[link] = start + op["s"]
                what = "host" if op["kind"] == "host" else f"exposed {op['op']}"
                if op["kind"] == "collective" and not op["async"]:
                    st.wait(st.free[link], what)
                else:
                    st.waits.append((op.get("done_pos"), st.free[link], what))
            else:
                st.clock += op["s"]
                st.spent[category(op)] += op["s"]
        st.settle(None)
        memo[comp] = (st.clock, dict(st.spent))
        return memo[comp]

    roots = [c for c in by_comp if c not in bodies]
    step, spent = 0.0, defaultdict(float)
    for r in roots:  # the entry (and any computation reached only through a call)
        s, sp = run(r)
        step += s
        for k, v in sp.items():
            spent[k] += v
    breakdown = {k: spent.get(k, 0.0) for k in CATEGORIES if k != "exposed_comm"}
    kinds = sorted(
        {f"exposed {o['op']}" for o in ops if o["kind"] == "collective"}
        | {k for k in spent if k.startswith("exposed ")}
    )
    exposed = {k: spent.get(k, 0.0) for k in kinds}
    breakdown["exposed_comm"] = sum(exposed.values())
    breakdown.update(exposed)
    return {"step_s": step, "breakdown": breakdown, "ops": costed}


def top_ops(sim: dict[str, Any], n: int = 10) -> list[dict[str, Any]]:
    """The `n` ops that cost most per step (collectives by their own time, hidden or not)."""
    rows = sorted((o for o in sim["ops"] if o["kind"] != "loop"), key=lambda o: -o["total_s"])
    return rows[:n]
