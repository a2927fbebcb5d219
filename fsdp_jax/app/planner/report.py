"""The planner's human side, what a user reads back: the warnings they can act on, the
per-strategy table, the bar chart and the per-parameter / collectives inspection, all
from the planner's JSON-able dicts.

    print(format_table(doc))                       # a `fsdp_jax.app.planner.estimate.plan_config` document
    print(format_inspection("full_shard", r))      # a `plan_strategy(..., inspect=True)` result

What a user types in (device counts, memory sizes, strategy lists; bad input raises
`PlanError`, whose message names the flag), its check against the config and the
commands' start-up (`load_planning_config`) are `fsdp_jax.app.planner.inputs`. Building, analysing and
compiling the step is `fsdp_jax.app.planner.one_strategy`; a config over its strategies,
`fsdp_jax.app.planner.estimate`.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from fsdp_jax.app.extras import require
from fsdp_jax.app.planner.grpo_plan import format_grpo
from fsdp_jax.app.planner.step_time import format_predictions
from fsdp_jax.sharding.precision import TAKE_UPDATES
from fsdp_jax.sharding.strategy import get_strategy

DEFAULT_REPLICATED_THRESHOLD = 1 << 20  # bytes: replicated params at least this big are flagged
COMPILED_OVER_ANALYTIC = 0.10  # flag a compiled peak this much above the analytic total


# ----------------------------------------------------------------------------- warnings


def fmt_bytes(n: float) -> str:
    """Decimal units, as GPU memory is quoted: 13.48 GB."""
    for unit, k in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= k:
            return f"{n / k:.2f} {unit}"
    return f"{int(n)} B"


def replicated_threshold_for(param_bytes: int, threshold: int | None = None) -> int:
    """The size from which a replicated parameter is flagged: `threshold`, or by default
    the larger of 1 MiB and 0.1% of all parameter bytes (so a 70B model's stacked norm
    scales, 2.6 MB each, pass, while a replicated embedding table does not)."""
    return threshold if threshold is not None else max(DEFAULT_REPLICATED_THRESHOLD, param_bytes // 1000)


def _as_row(r) -> dict[str, Any]:
    return r.as_dict() if hasattr(r, "as_dict") else dict(r)


def embedding_gradient(op_name: str) -> bool:
    """An embedding lookup's gradient: the transpose of `jnp.take` (jit(_take)), a scatter-add.
    XLA partitions it by moving the token gradients with an all-to-all so that each device sums
    into its own slice of the table (`fsdp_jax.sharding.precision.take`; docs/planning.md), which
    is the layout the project asks for, not an activation resharded against it; so is the
    all-to-all `take` asks for itself (its TAKE_UPDATES scope, hybrid_shard)."""
    return ("jit(_take)" in op_name and op_name.endswith("scatter-add")) or f"/{TAKE_UPDATES}/" in op_name


def explicit_all_to_all(op_name: str) -> bool:
    """A `jax.lax.all_to_all` the program asked for inside a `shard_map` (expert parallelism's
    token exchange, `models/moe_exchange.py`), not one the partitioner chose."""
    return op_name.endswith("shard_map/all_to_all")


def sharding_warnings(
    rows,
    report: dict[str, Any] | None,
    strategy: str,
    mesh_shape_: dict[str, int],
    *,
    analytic_total: int | None = None,
    compiled_peak: int | None = None,
    layer_gather_bytes: int | None = None,
    cpu_upcast: bool = False,
    replicated_threshold: int = DEFAULT_REPLICATED_THRESHOLD,
) -> list[str]:
    """Problems a user can act on, one sentence each.

    `rows`: the plan's at-rest rows (`LeafSharding` or their `as_dict()`); `report`:
    `collective_report` of the compiled step; `layer_gather_bytes`: the bytes one
    step may legitimately all-gather outside the layer loop (unstacked params), so
    anything well above it means the per-layer gathers were hoisted.
    """
    s = get_strategy(strategy)
    out: list[str] = []
    rows = [_as_row(r) for r in rows]
    group = [a for a in s.params if mesh_shape_.get(a, 1) > 1]
    if group:
        big = [r for r in rows if not any(a in r["spec"] for a in group) and r["total_bytes"] >= replicated_threshold]
        for r in sorted(big, key=lambda r: -r["total_bytes"]):
            out.append(
                f"replicated parameter: {r['path']} {tuple(r['shape'])} {r['spec']} holds "
                f"{fmt_bytes(r['total_bytes'])} on every device ({r['reason']}); annotate it "
                f"with logical names that map to fsdp (e.g. 'embed'), or fix the rule that "
                f"maps it to no axis"
            )
    if report is not None:
        a2a = report["per_step"].get("all-to-all")
        ops = [n for w in ("inside_loop", "outside_loop") for n in report[w].get("all-to-all", {}).get("op_names", [])]
        others = [n for n in ops if not (embedding_gradient(n) or explicit_all_to_all(n))]
        if a2a and others:
            names = sorted({n.split("/")[-1] for n in others})[:4]
            table = (
                f" (and {len(ops) - len(others)} for the embedding gradient or the experts' exchange, by design)"
                if len(others) < len(ops)
                else ""
            )
            out.append(
                f"activations resharded with all-to-all: {len(others)} per step{table}, "
                f"{fmt_bytes(a2a['bytes'])} in all (ops: {', '.join(names)}); the partitioner "
                f"chose its own activation layout: constrain block inputs/outputs to "
                f"batch over (data, fsdp) with flax.linen.with_logical_constraint"
            )
        ag_out = report["outside_loop"].get("all-gather", {}).get("bytes", 0)
        if group and not s.gather_once and layer_gather_bytes is not None:
            if not report["loops"]:
                if report["per_step"].get("all-gather"):
                    out.append(
                        "no layer loop in the compiled step: parameter all-gathers cannot be "
                        "checked for hoisting; scan the layers (nnx.scan) to keep them per layer"
                    )
            elif ag_out > 1.5 * layer_gather_bytes + (1 << 20):
                out.append(
                    f"parameter all-gathers hoisted out of the layer loop: {fmt_bytes(ag_out)} "
                    f"gathered outside it (expected <= {fmt_bytes(layer_gather_bytes)} for the "
                    f"unstacked params), so the full model is resident; check that the layer "
                    f"params stay inside the scanned body and that nothing constrains them "
                    f"to a replicated layout"
                )
    if analytic_total and compiled_peak and compiled_peak > (1 + COMPILED_OVER_ANALYTIC) * analytic_total:
        why = (
            " XLA:CPU upcasts bf16 matmuls and collectives to f32, which inflates temp: "
            "recheck on the target accelerator"
            if cpu_upcast
            else ""
        )
        out.append(
            f"{strategy}: compiled peak {fmt_bytes(compiled_peak)} exceeds the analytic "
            f"estimate {fmt_bytes(analytic_total)} by {compiled_peak / analytic_total - 1:.0%} "
            f"(> {COMPILED_OVER_ANALYTIC:.0%}).{why}"
        )
    return out


# ----------------------------------------------------------------------------- output


def format_table(doc: dict[str, Any]) -> str:
    """The classic per-device table (params, grads, optimizer state, states total),
    then measured vs analytic columns, fit and headroom."""
    biggest = max(max(r["compiled"]["peak"], r["analytic"]["total"]) for r in doc["strategies"].values())
    unit, k = next((u, k) for u, k in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3), ("B", 1)) if biggest >= 10 * k or k == 1)
    gb = lambda n: f"{n / k:9.2f}"  # noqa: E731
    lines = [
        f"{doc['config'] or 'config'}: {doc['params'] / 1e9:.3f}B params "
        f"({doc['params']:,}), {doc['devices']} devices; bytes per device in {unit} "
        f"(1 {unit} = {k:.0e} bytes)"
    ]
    lines += ["  " + n for n in doc["notes"]]
    lines.append("")
    lines += _analytic_table(doc, gb)
    lines.append("")
    lines += _compiled_table(doc, gb)
    first = next(iter(doc["strategies"].values()))
    act = first["activations_by_remat"]
    lines.append("")
    lines.append(
        "analytic activations per device by remat policy (same batch): "
        + ", ".join(f"{name} {fmt_bytes(v)}" for name, v in act.items())
    )

    lines += format_grpo(doc, gb)
    lines += format_predictions(doc, explain=doc.get("explain_time") or 0)
    warns = [(n, w) for n, r in doc["strategies"].items() for w in r["warnings"]]
    if warns:
        lines.append("")
        lines += [f"warning [{n}]: {w}" for n, w in warns]
    lines.append(f"planned in {doc['wall_s']:.1f}s")
    return "\n".join(lines)


def _analytic_table(doc: dict[str, Any], gb) -> list[str]:
    """`format_table`'s analytic part: per strategy the states (params, grads, optimizer),
    bytes per parameter, gathered params, activations and the total; `gb` formats bytes."""
    lines = [
        "analytic (states = params + grads + optimizer, from the sharding plan; gathered and "
        "activations from formulas; total = states + gathered + activations + batch, or states + batch + "
        "one layer's gradient reduction where that phase is larger, marked *):"
    ]
    hdr = (
        f"{'strategy':<14}{'as':<13}{'params':>9}{'grads':>9}{'optim':>9}{'states':>9}"
        f"{'B/param':>9}{'gathered':>9}{'activ':>9}{'total':>9}"
    )
    lines += [hdr, "-" * len(hdr)]
    for name, r in doc["strategies"].items():
        a = r["analytic"]
        lines.append(
            f"{name:<14}{r['classic_name']:<13}{gb(a['params'])}{gb(a['grads'])}"
            f"{gb(a['optimizer'])}{gb(a['states'])}{r['bytes_per_param']:9.2f}"
            f"{gb(a['gathered'])}{gb(a['activations'])}{gb(a['total'])}"
            + (
                "*"
                if a["total"] - a.get("tile_padding", 0) > a["states"] + a["batch"] + a["gathered"] + a["activations"]
                else ""
            )
        )
    pads = {n: r["analytic"]["tile_padding"] for n, r in doc["strategies"].items() if "tile_padding" in r["analytic"]}
    if pads:
        lines.append(
            "total and the argument bytes below include XLA:TPU's tile padding of the arguments "
            "(each shard padded to its input layout's tiles): "
            + ", ".join(f"{n} {fmt_bytes(v)}" for n, v in pads.items())
        )
    return lines


def _compiled_table(doc: dict[str, Any], gb) -> list[str]:
    """`format_table`'s measured part: per strategy the mesh, the compiled argument (and
    its ratio to the analytic one), temp and peak, whether it fits, the headroom and the
    compile time; then compiled vs analytic per term when every strategy has them."""
    lines: list[str] = []
    tgt = doc.get("target")
    on = (
        f"XLA:TPU for {tgt['name']}, {tgt['hosts']} slice(s) of {tgt['topology_name']}"
        if tgt and tgt.get("topology_name")
        else f"XLA:GPU for {tgt['name']}, {tgt['hosts']} x {tgt['gpus_per_host']} GPUs"
        if tgt
        else "/".join(sorted({r.get("platform", "?") for r in doc["strategies"].values()}))
    )
    lines.append(f"compiled (memory_analysis() of the AOT-compiled train step, {on}; measured):")
    hdr = (
        f"{'strategy':<14}{'mesh':<10}{'argument':>9}{'arg/ana':>8}{'temp':>9}{'peak':>9}"
        f"{'fits':>6}{'headroom':>10}{'compile':>9}"
    )
    lines += [hdr, "-" * len(hdr)]
    for name, r in doc["strategies"].items():
        c, m = r["compiled"], r["mesh"]
        fits = "-" if r["fits"] is None else ("yes" if r["fits"] else "NO")
        head = "" if r["headroom"] is None else gb(r["headroom"])
        lines.append(
            f"{name:<14}{m.get('data', 1)}x{m.get('fsdp', 1)}x{m.get('tensor', 1):<6}"
            f"{gb(c['argument'])}{r['argument_vs_analytic']:+8.2%}{gb(c['temp'])}"
            f"{gb(c['peak'])}{fits:>6}{head:>10}{r['compile_s']:8.1f}s"
        )
    if doc.get("device_memory"):
        lines.append(f"device memory {fmt_bytes(doc['device_memory'])}; fits = compiled peak <= device memory")
    if all("terms" in r for r in doc["strategies"].values()):
        lines.append("")
        lines.append(
            "compiled vs analytic, per term (compiled / analytic - 1): argument = params + "
            "optimizer + batch (+ tile padding on TPU); temp = grads + gathered + activations; peak = total"
        )
        for name, r in doc["strategies"].items():
            t = r["terms"]
            lines.append(f"{name:<14}argument {t['argument']:+8.2%}   temp {t['temp']:+8.2%}   peak {t['peak']:+8.2%}")
    return lines


def plot_plan(doc: dict[str, Any], path: str) -> None:
    """Stacked bars per strategy (params, grads, optimizer, gathered, activations: analytic)
    with the compiled peak as a marker and the device memory as a line; PNG via Agg."""

    matplotlib = require("matplotlib", "--plot")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(doc["strategies"])
    an = [doc["strategies"][n]["analytic"] for n in names]
    parts = {p: [a[p] for a in an] for p in ("params", "grads", "optimizer", "gathered", "activations")}
    fig, axis = plt.subplots(figsize=(1.6 * len(names) + 5, 4.5))
    bottom = np.zeros(len(names))
    for part, vals in parts.items():
        vals = np.array(vals) / 1e9
        axis.bar(names, vals, bottom=bottom, label=f"{part} (analytic)")
        bottom += vals
    peaks = [doc["strategies"][n]["compiled"]["peak"] / 1e9 for n in names]
    axis.scatter(names, peaks, marker="_", s=900, color="k", zorder=3, label="compiled peak")
    if doc.get("device_memory"):
        axis.axhline(doc["device_memory"] / 1e9, color="r", ls="--", label="device memory")
    axis.set_xticks(range(len(names)), [f"{n}\n({doc['strategies'][n]['classic_name']})" for n in names])
    axis.set_ylabel("GB per device")
    axis.set_title(f"{doc['config']}: {doc['params'] / 1e9:.2f}B params on {doc['devices']} devices")
    axis.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def format_inspection(name: str, r: dict[str, Any]) -> str:
    """Text form of one `plan_strategy(..., inspect=True)` result."""
    rows = r["rows"]
    wp = max([len("path")] + [len(x["path"]) for x in rows]) + 2
    ws = max([len("spec")] + [len(x["spec"]) for x in rows]) + 2
    wsh = max([len("shape")] + [len(str(tuple(x["shape"]))) for x in rows]) + 2
    lines = [f"{name} on mesh {r['mesh']}: per-parameter layout at rest"]
    hdr = f"{'path':<{wp}}{'shape':<{wsh}}{'dtype':<10}{'spec':<{ws}}{'bytes/device':>14}  why"
    lines += [hdr, "-" * len(hdr)]
    for row in rows:
        lines.append(
            f"{row['path']:<{wp}}{str(tuple(row['shape'])):<{wsh}}{row['dtype']:<10}"
            f"{row['spec']:<{ws}}{row['bytes_per_device']:>14,}  {row['reason']}"
        )
    lines.append(f"{'total':<{wp + wsh + 10 + ws}}{sum(x['bytes_per_device'] for x in rows):>14,}")
    rep = r["collectives"]
    lines.append("")
    loops = ", ".join(f"{lp['op_name'] or lp['body']} x{lp['trip_count']}" for lp in rep["loops"]) or "none"
    lines.append(f"collectives in the compiled step, per device (loops: {loops})")
    hdr = f"{'op':<20}{'where':<14}{'in HLO':>7}{'runs/step':>10}{'bytes/step':>14}  dtypes"
    lines += [hdr, "-" * len(hdr)]
    for where in ("inside_loop", "outside_loop"):
        for op, e in sorted(rep[where].items()):
            lines.append(
                f"{op:<20}{where:<14}{e['count']:>7}{e['runs']:>10}{fmt_bytes(e['bytes_per_step']):>14}  {e['dtypes']}"
            )
    for op, e in sorted(rep["per_step"].items()):
        lines.append(f"{op:<20}{'total':<14}{'':>7}{e['count']:>10}{fmt_bytes(e['bytes']):>14}")
    if r.get("schedule"):
        lines.append("")
        lines += format_schedule(r["schedule"])
    if r.get("platform") == "cpu":
        lines.append(
            "(XLA:CPU: gradient reductions show as all-reduce, never reduce-scatter, and bf16 "
            "collectives run in f32; GPU/TPU compiles differ)"
        )
    c, a = r["compiled"], r["analytic"]
    lines.append("")
    lines.append(
        f"memory per device: compiled peak {fmt_bytes(c['peak'])} (argument "
        f"{fmt_bytes(c['argument'])}, temp {fmt_bytes(c['temp'])}); analytic total "
        f"{fmt_bytes(a['total'])}"
    )
    lines += [f"warning: {w}" for w in r["warnings"]] or ["no warnings"]
    return "\n".join(lines)


def format_schedule(schedule: list[dict[str, Any]]) -> list[str]:
    """One line per collective of `fsdp_jax.hlo.schedule.collective_schedule`: kind, dtype, bytes,
    runs per step, loop and pass, async, compute scheduled between start and done, and
    the replica group (size; whether it crosses hosts)."""
    lines = [
        "every collective of the scheduled program (bytes per device per run; overlap = compute "
        "ops scheduled between start and done, of them GEMMs)"
    ]
    hdr = (
        f"{'op':<19}{'dtype':<10}{'bytes':>11}{'runs':>6}  {'pass':<9}{'loop':<30}{'async':<7}"
        f"{'overlap':<14}{'group':<6}hosts"
    )
    lines += [hdr, "-" * len(hdr)]
    for c in sorted(schedule, key=lambda c: (c["phase"], c["loop"] or "", c["op"])):
        if not c["async"]:
            ov = "sync"
        elif c["overlap"] is None:
            ov = "pipelined"
        else:
            ov = f"{c['overlap']['ops']} ({c['overlap']['gemms']} gemm)"
        loop = (c["loop"] or "-")[-29:]
        hosts = "-" if c["crosses_hosts"] is None else ("across" if c["crosses_hosts"] else "within")
        lines.append(
            f"{c['op']:<19}{c['dtype']:<10}{fmt_bytes(c['bytes']):>11}{c['runs']:>6}  "
            f"{c['phase']:<9}{loop:<30}{'yes' if c['async'] else 'no':<7}{ov:<14}"
            f"{c['group_size'] or '?'!s:<6}{hosts}"
        )
    return lines
