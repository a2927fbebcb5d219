"""Predicted step time of a GPU- or TPU-target plan: op by op from the compiled program.

    pred = predict(cfg, "h100", n_devices, strategy_result)   # planner's per-strategy dict
    pred["step_s"], pred["band_s"], pred["breakdown"], pred["top_ops"], pred["mfu"]

Two models, one entry (`predict`):
- `predict_ops`, whenever the planner compiled the step for a target (its result carries the
  program's `op_inventory`, `fsdp_jax.hlo.costs`): each op costed from its shapes and the
  target's table (`fsdp_jax/targets/perf_tables.json`, every constant with its source), run
  through the compiled schedule with only the compute between an async collective's start
  and done hiding it (`fsdp_jax.app.planner.op_costs`). The breakdown: gemm, attention,
  memory (memory-bound fusions of the model), update (the optimizer and what else runs
  outside forward and backward), host (transfers), exposed_comm and "exposed <kind>".
  Held against published runs in `fsdp_jax.app.planner.published` (docs/step_time.md).
- `predict_roofline`, for results without a program (the search's analytic candidates,
  hand-built results): a roofline with the same table's constants (`roofline_constants`).

The roofline: the model's FLOPs from its shape (PaLM's count: 6 x matmul params + 12 x
layers x d_attn x seq per token; a remat policy whose record recomputes the `FORWARD`,
`full`, adds one more forward) at the table's
dense bf16 peak x GEMM efficiency (`gemm.max_efficiency`), the collective bytes over the
table's fast link (NVLink; ICI on TPU) and slow network (the NIC; DCN), assumed hidden up to
the compute time, and the optimizer update's state traffic at the table's HBM bandwidth x
efficiency: step = max(compute, communication) + update. It leaves out what only a program
shows (memory-bound fusions, exposed collectives, wave quantization, kernel launches), so for
the same plan it mostly predicts a shorter step than `predict_ops` (not always: it costs
attention as dense matmuls, where the op walk costs a causal flash kernel at its own
throughput); the search ranks by it only until a candidate is compiled, and compiles the
candidates ranked above the best compiled fit next. MFU is model FLOPs (no recompute) /
(step x peak).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any

from fsdp_jax.app.config.fp8_checks import target_platform, unscaled_experts
from fsdp_jax.app.models.decoder import count_params
from fsdp_jax.app.models.lora import adapter_param_count, spec_from_config
from fsdp_jax.app.objectives.preference_run import is_preference, pair_rows, preference_spec
from fsdp_jax.app.objectives.reference import choose_reference
from fsdp_jax.app.planner.op_costs import above_best_mfu, simulate, top_ops
from fsdp_jax.app.planner.residuals import rematerialised
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.sharding.remat import FORWARD, remat_policy
from fsdp_jax.targets.perf_tables import perf_table


def model_flops_per_token(model, seq_len: int, lora=None) -> tuple[float, float]:
    """(matmul FLOPs per token of forward + backward, of which attention's S x S part).
    With `lora` (a `LoraSpec`) the base is frozen: 4 FLOPs per base param (no weight
    gradient), 6 per adapter param."""

    d, v = model.d_model, model.vocab_size
    # the embedding lookup does no matmul; a tied head multiplies by the same table; a
    # mixture of experts multiplies each token by its top-k experts only (active params)
    matmul = count_params(model, active=True) - (0 if model.tie_word_embeddings else v * d)
    attn = 12 * model.n_layers * model.n_heads * model.head_dim * seq_len
    if lora is not None:
        return 4 * matmul + 6 * adapter_param_count(model, lora, active=True) + attn, attn
    return 6 * matmul + attn, attn


def fp8_layer_params(cfg, active: bool = False, target: str | None = None) -> int:
    """Params of the decoder layers (all but the embedding, the head and the final norm; MTP
    depths left out) under `precision ...,matmul=fp8`, else 0: the weights whose GEMMs run in FP8
    and whose per-layer gathers move f8 (docs/fp8.md; the few non-FP8 layer params, norms, the
    router, a shared expert, counted with them, as the memory model counts the gathered layer in
    f8 throughout). `active`: a token's experts only (top-k of n_experts). Routed experts whose
    grouped products tokamax's kernels run on `target` (a perf-table name; None: this host's
    CPU) are left out: those products and their weights' gathers stay in the compute dtype
    (`fp8_checks.unscaled_experts`)."""
    if Policy.parse(cfg.precision).matmul != "fp8":
        return 0
    m = dataclasses.replace(cfg.model, mtp_depth=0)
    tables = 1 if m.tie_word_embeddings else 2
    layers = count_params(m, active=active) - tables * m.vocab_size * m.d_model - m.d_model
    if unscaled_experts(cfg, *target_platform(target)) is None:
        return layers
    sparse = sum(m.is_sparse(i) for i in range(m.n_layers))
    return layers - sparse * 3 * (m.experts_per_token if active else m.n_experts) * m.d_model * m.moe_ffn_dim


def step_rows(cfg) -> int:
    """Rows the step trains per global-batch example: 2 for a preference pair (chosen and
    rejected, as the trainer's logged tokens_per_s counts them), else 1 (a packed preference
    row holds its pairs' sequences: `preference_run.pair_rows`)."""
    return pair_rows(cfg)


def step_tokens(cfg, n_devices: int) -> float:
    """Tokens per device per step (both rows of a preference pair)."""
    return cfg.data.seq_len * cfg.train.global_batch * step_rows(cfg) / n_devices


def reference_flops_per_token(cfg) -> float:
    """Forward FLOPs per token of the reference model a preference step runs beside the policy
    (a frozen copy in model state, or the LoRA base with the adapters off): a third of the
    full model's forward + backward count; 0 when its log-probs are precomputed or the loss
    is reference-free (`fsdp_jax.app.objectives.reference.choose_reference`)."""
    if not is_preference(cfg):
        return 0.0
    lora = spec_from_config(cfg.lora)
    reference = choose_reference(preference_spec(cfg), lora is not None, cfg.preference.precompute_ref_log_probs)
    return model_flops_per_token(cfg.model, cfg.data.seq_len)[0] / 3 if reference in ("state", "adapters_off") else 0.0


def roofline_constants(target: str) -> dict[str, float | None]:
    """The roofline's constants for `target` (a GPU in `fsdp_jax/targets/perf_tables.json` or
    a TPU generation / slice name), from the table the op-by-op model costs with: `peak` (dense
    bf16 FLOP/s), `efficiency` (its `gemm.max_efficiency`), `fast` and `slow` (bus bytes/s of
    the link within a host / slice and of the network across them; `slow` None where
    unpublished), `hbm` (bytes/s reached: bandwidth x efficiency), `host` (the host link's
    bytes/s per device and direction). Raises ValueError for a target the table has no
    figures for."""

    t = perf_table(target)
    return {
        "peak": t["peak_flops"]["bf16"],
        "efficiency": t["gemm"]["max_efficiency"],
        "fast": t["links"]["fast"]["bus_bytes_per_s"],
        "slow": t["links"]["slow"].get("bus_bytes_per_s"),
        "hbm": t["hbm"]["bytes_per_s"] * t["hbm"]["efficiency"],
        "host": t["host"]["bytes_per_s"],
    }


BAND = 0.15  # the tolerance the op walk is held to against published runs (docs/step_time.md)
TOP_OPS = 25  # ops kept per prediction for `plan --explain-time`


def predict(cfg, target: str, n_devices: int, result: dict[str, Any]) -> dict[str, Any] | None:
    """The predicted step of one strategy's planner result on `target`: from its compiled
    program op by op (`predict_ops`) when the result carries the program's `op_inventory`
    (a GPU- or TPU-target compile), else the roofline over its traffic (`predict_roofline`:
    the search's analytic candidates, hand-built results)."""
    if result.get("op_inventory"):
        return predict_ops(cfg, target, n_devices, result)
    return predict_roofline(cfg, target, n_devices, result)


def predict_ops(cfg, target: str, n_devices: int, result: dict[str, Any], top: int = TOP_OPS) -> dict[str, Any] | None:
    """The step from the compiled program's ops (`fsdp_jax.app.planner.op_costs.simulate` over
    `result["op_inventory"]` with `fsdp_jax.targets.perf_tables.perf_table(target)`): step_s,
    tokens/s, TFLOP/s and MFU per device (model FLOPs: PaLM's count, as `predict_roofline`),
    the breakdown (gemm, attention, memory, update, host, exposed_comm and exposed by kind),
    a band of +-BAND, and the `top` ops by time per step. None where a collective crosses a
    network whose bandwidth is unpublished."""

    t0 = time.perf_counter()
    try:
        table = perf_table(target)
        sim = simulate(result["op_inventory"], table)
    except ValueError:
        return None
    simulate_s = time.perf_counter() - t0
    step_s, b = sim["step_s"], sim["breakdown"]
    tokens = step_tokens(cfg, n_devices)
    lora = spec_from_config(cfg.lora)  # a frozen base: no weight gradients (4 FLOPs per param, not 6)
    model_flops = tokens * (
        model_flops_per_token(cfg.model, cfg.data.seq_len, lora)[0] + reference_flops_per_token(cfg)
    )
    peak = table["peak_flops"]["bf16"]
    g = lambda x: float(f"{x:.4g}")  # noqa: E731
    compute = b["gemm"] + b["attention"] + b["memory"]
    return {
        "model": "ops",
        "step_s": g(step_s),
        "band_s": [g(step_s * (1 - BAND)), g(step_s * (1 + BAND))],
        "tokens_per_s_per_gpu": g(tokens / step_s),
        "tflops_per_gpu": g(model_flops / step_s / 1e12),
        "mfu": g(model_flops / step_s / peak),
        "compute_s": g(compute),
        "comm_s": g(b["exposed_comm"]),
        "update_s": g(b["update"]),
        "host_s": g(b["host"]),
        "breakdown": {k: g(v) for k, v in b.items()},
        "bound": "compute" if compute >= b["exposed_comm"] else "communication",
        "top_ops": [_op_row(o, g) for o in top_ops(sim, top)],
        # seconds the prediction cost on top of the compile: the op walk (in the compiling
        # process) + the schedule's simulation (here)
        "predict_s": round(result.get("op_inventory_s", 0.0) + simulate_s, 3),
        "above_best_mfu": above_best_mfu(model_flops / step_s / peak, table),
        "costed": costed(cfg, result["op_inventory"]),
    }


def costed(cfg, ops: list[dict[str, Any]] | None) -> dict[str, str]:
    """Whether the prediction costed the plan's attention kernel and its activation offload,
    in words: `attention` and `offload`. `ops`: the compiled program's op inventory the
    prediction walked; None for the roofline, which sees neither (it counts attention's
    FLOPs at the GEMM rate and moves nothing over the host link)."""

    kernel = cfg.model.attention
    offloads = bool(remat_policy(cfg.remat).offloads)
    if ops is None:
        return {
            "attention": f"{kernel}: not costed as a kernel (the roofline counts attention's FLOPs at the GEMM rate)",
            "offload": f"remat={cfg.remat}: not costed (the roofline has no host transfers)" if offloads else "none",
        }
    calls = [o for o in ops if o["kind"] == "attention"]
    by_kernel = {k: sum(o["runs"] for o in calls if o.get("kernel", "cudnn") == k) for k in ("cudnn", "splash")}
    if kernel == "xla":
        attention = "xla: costed as the program's GEMMs and fusions"
    elif by_kernel.get(kernel):
        attention = f"{kernel}: costed, {by_kernel[kernel]} kernel calls per step"
    else:
        attention = f"{kernel}: not costed as a kernel (no {kernel} call in the compiled program)"
    moved = sum(o["bytes"] * o["runs"] for o in ops if o["kind"] == "host")
    if not offloads:
        offload = "none" if not moved else f"costed: {moved / 1e9:.2f} GB per step over the host link"
    elif moved:
        offload = f"remat={cfg.remat}: costed, {moved / 1e9:.2f} GB per step over the host link"
    else:
        offload = f"remat={cfg.remat}: not costed (no host transfer in the compiled program)"
    return {"attention": attention, "offload": offload}


def _op_row(o: dict[str, Any], g) -> dict[str, Any]:
    """One op of `--explain-time`: name, kind, seconds per step, runs and what sized it."""
    shape = {
        "gemm": lambda: (
            f"{o['dtype']} m={o['m']} n={o['n']} k={o['k']}" + (f" batch={o['batch']}" if o["batch"] > 1 else "")
        ),
        "attention": lambda: (
            f"{o['direction']} b={o['b']} h={o['h']} s={o['sq']} d={o['d']}" + (" causal" if o["causal"] else "")
        ),
        "collective": lambda: (
            f"{o['op']} {o['bytes'] / 1e6:.1f} MB over {o['group_size']}"
            + (" across hosts" if o.get("crosses_hosts") else "")
            + ("" if o["async"] else " sync")
        ),
    }.get(o["kind"], lambda: f"{o.get('bytes', 0) / 1e6:.1f} MB")()
    return {"name": o["name"], "kind": o["kind"], "total_s": g(o["total_s"]), "runs": o["runs"], "what": shape}


def predict_roofline(cfg, target: str, n_devices: int, result: dict[str, Any]) -> dict[str, Any] | None:
    """Predicted step time, tokens/s per device (GPU or TPU chip; a v4 core), TFLOP/s per
    device and MFU for one strategy's planner result on `target` (`roofline_constants`: the
    op-by-op model's table). None when the program crosses a network whose bandwidth is
    unpublished (v4 and v6e slices over the data-center network)."""
    k = roofline_constants(target)
    seq = cfg.data.seq_len
    tokens = step_tokens(cfg, n_devices)  # per device per step
    lora = spec_from_config(cfg.lora)
    per_token, attn = model_flops_per_token(cfg.model, seq, lora)
    per_token += reference_flops_per_token(cfg)  # a preference step's reference forward
    forward = (model_flops_per_token(cfg.model, seq)[0] - attn) / 3 + attn / 3  # what full remat redoes
    redo = FORWARD in rematerialised(cfg.remat).recomputes
    recompute = forward if redo else 0.0  # one more forward
    # FP8 GEMMs (the layers' weights, `fp8_layer_params`) at the target's FP8 peak, the rest at bf16's
    f8 = 6 * fp8_layer_params(cfg, active=True, target=target) * (4 / 3 if redo else 1)
    peak8 = perf_table(target)["peak_flops"].get("f8e4m3fn", k["peak"])
    compute_s = tokens * ((per_token + recompute - f8) / k["peak"] + f8 / peak8) / k["efficiency"]
    com = result.get("communication") or {}
    total = com.get("total_wire_bytes", 0)
    cross = sum(e.get("cross_host_wire_bytes", 0) for e in com.values() if isinstance(e, dict))
    if cross and k["slow"] is None:
        return None
    comm_s = (total - cross) / k["fast"] + (cross / k["slow"] if cross else 0.0)
    # the update reads grads, params and optimizer state and writes params and state
    a = result["analytic"]
    update_s = (a["grads"] + 2 * (a.get("trainable", a["params"]) + a["optimizer"])) / k["hbm"]  # LoRA: adapters
    step_s = max(compute_s, comm_s) + update_s
    model_flops = tokens * per_token
    g = lambda x: float(f"{x:.4g}")  # noqa: E731  (4 significant digits: tiny test steps too)
    return {
        "model": "roofline",
        "step_s": g(step_s),
        "tokens_per_s_per_gpu": g(tokens / step_s),
        "tflops_per_gpu": g(model_flops / step_s / 1e12),
        "mfu": g(model_flops / step_s / k["peak"]),
        "compute_s": g(compute_s),
        "comm_s": g(comm_s),
        "update_s": g(update_s),
        "bound": "compute" if compute_s >= comm_s else "communication",
        "above_best_mfu": above_best_mfu(model_flops / step_s / k["peak"], perf_table(target)),
        "costed": costed(cfg, None),
    }


def format_predictions(doc: dict[str, Any], explain: int = 0) -> list[str]:
    """Lines for the planner's table (empty when no strategy has a prediction); a plan that
    does not fit is still predicted and marked so. `explain`: list that many top ops per
    strategy (`plan --explain-time`)."""
    rows = [(n, r["predicted"], r.get("fits")) for n, r in doc["strategies"].items() if r.get("predicted")]
    if not rows:
        return []
    per = "dev" if (doc.get("target") or {}).get("topology_name") else "GPU"  # a TPU chip (v4: core)
    if any(p.get("model") == "ops" for _, p, _ in rows):
        return _format_ops(rows, per, explain)
    lines = [
        "",
        "predicted step time (roofline over the program's traffic, with the op-by-op model's "
        "table: peak x GEMM efficiency, links, HBM; fsdp_jax.app.planner.step_time):",
    ]
    hdr = (
        f"{'strategy':<14}{'step s':>9}{'compute':>9}{'comm':>9}{'update':>9}{'tok/s/' + per:>11}"
        f"{'TFLOP/s':>9}{'MFU':>7}  bound"
    )
    lines += [hdr, "-" * len(hdr)]
    for n, p, fits in rows:
        lines.append(
            f"{n:<14}{p['step_s']:9.3f}{p['compute_s']:9.3f}{p['comm_s']:9.3f}{p['update_s']:9.3f}"
            f"{p['tokens_per_s_per_gpu']:11,.0f}{p['tflops_per_gpu']:9.1f}{p['mfu']:7.1%}  {p['bound']}"
            + ("  (does not fit)" if fits is False else "")
        )
        lines += _notes(p)
    return lines


def _notes(p: dict[str, Any]) -> list[str]:
    """The lines under a strategy's prediction that say what it should not be trusted for: an
    MFU above the chip's best published one, a requested kernel or offload it did not cost."""
    out = [" " * 14 + f"warning: {p['above_best_mfu']}"] if p.get("above_best_mfu") else []
    missed = [v for v in (p.get("costed") or {}).values() if "not costed" in v]
    return out + ([" " * 14 + "not costed: " + "; ".join(missed)] if missed else [])


def _format_ops(rows, per: str, explain: int) -> list[str]:
    lines = [
        "",
        "predicted step time, op by op from the compiled program (seconds per step; band +-"
        f"{BAND:.0%}; exposed = communication the schedule does not hide; docs/step_time.md):",
    ]
    hdr = (
        f"{'strategy':<14}{'step s':>8}{'band':>14}{'gemm':>7}{'attn':>7}{'memory':>7}{'update':>7}"
        f"{'exposed':>8}{'host':>6}{'tok/s/' + per:>11}{'TFLOP/s':>8}{'MFU':>7}"
    )
    lines += [hdr, "-" * len(hdr)]
    for n, p, fits in rows:
        if p.get("model") != "ops":  # no program to walk (the compiler refused it): the roofline
            lines.append(
                f"{n:<14}{p['step_s']:8.3f}{'':>14}{'':>42}{p['tokens_per_s_per_gpu']:11,.0f}"
                f"{p['tflops_per_gpu']:8.1f}{p['mfu']:7.1%}  (does not fit: the compiler refused it; roofline)"
            )
            lines += _notes(p)
            continue
        b = p.get("breakdown") or {}
        lo, hi = p.get("band_s") or (p["step_s"], p["step_s"])
        lines.append(
            f"{n:<14}{p['step_s']:8.3f}{f'{lo:.2f}-{hi:.2f}':>14}{b.get('gemm', 0):7.3f}{b.get('attention', 0):7.3f}"
            f"{b.get('memory', 0):7.3f}{b.get('update', 0):7.3f}{b.get('exposed_comm', p['comm_s']):8.3f}"
            f"{b.get('host', 0):6.3f}{p['tokens_per_s_per_gpu']:11,.0f}{p['tflops_per_gpu']:8.1f}{p['mfu']:7.1%}"
            + ("  (does not fit)" if fits is False else "")
        )
        exposed = {k.removeprefix("exposed "): v for k, v in b.items() if k.startswith("exposed ") and v > 0}
        if exposed:
            lines.append(" " * 14 + "exposed: " + ", ".join(f"{k} {v:.3f} s" for k, v in exposed.items()))
        if "predict_s" in p:
            lines.append(" " * 14 + f"predicted in {p['predict_s']:.2f} s on top of the compile (op walk + schedule)")
        lines += _notes(p)
    for n, p, _ in rows if explain else ():
        lines += ["", f"{n}: the {min(explain, len(p.get('top_ops', [])))} ops that cost most per step"]
        for o in p.get("top_ops", [])[:explain]:
            lines.append(f"  {o['total_s']:8.4f} s  {o['kind']:<10} x{o['runs']:<4} {o['name']}  ({o['what']})")
    return lines
