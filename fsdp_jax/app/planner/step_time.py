"""Predicted step time of a GPU- or TPU-target plan: a roofline over the compiled program's traffic.

    pred = predict(cfg, "h100", n_devices, strategy_result)   # planner's per-strategy dict
    pred["step_s"], pred["tokens_per_s_per_gpu"], pred["mfu"]   # per device: a GPU or TPU chip

TPU targets (`v5p`, ...) take the Cloud TPU pages' per-chip figures
(`fsdp_jax.targets.tpu.TPU_SPECS`): ICI within a slice in place of NVLink (half the
bidirectional figure per direction, which is also the pages' all-reduce bandwidth per
chip), the data-center network across slices in place of the NIC, and the same
GEMM_EFFICIENCY (an assumption for the MXUs as for the tensor cores).

Inputs: the model's FLOPs from its shape (PaLM's count: 6 x matmul params + 12 x layers x
d_attn x seq per token; `remat: full` adds the recomputed forward), the bytes the compiled
XLA:GPU program's collectives send per device (`communication`, ring algorithms, split
into within-host and cross-host), the optimizer update's state traffic, and the target's
published peaks (`SPECS`). XLA's own cost analysis is not used: it counts a while loop's
body once, i.e. one layer of a scanned model.

step = max(compute, communication) + update: the async collectives are assumed hidden
behind compute up to the compute time (the planner warns where the compiled schedule has
nothing between a collective's start and done). compute = hardware FLOPs / (peak x
`GEMM_EFFICIENCY`). That efficiency is an assumption, not fitted: large bf16 GEMMs on an
H100 SXM run at roughly 70-80% of the 989 TFLOP/s dense peak; attention, norms and
elementwise work are folded into it. MFU is model FLOPs (no recompute) / (step x peak).
"""

from __future__ import annotations

from typing import Any

# name -> (dense bf16 FLOP/s, NVLink bytes/s per GPU per direction, network bytes/s per GPU)
# H100/H200 SXM: 989 TFLOP/s, NVLink 4 900 GB/s bidirectional, one 400 Gb/s NIC per GPU;
# A100 SXM: 312 TFLOP/s, NVLink 3 600 GB/s, one 200 Gb/s NIC per GPU.
SPECS: dict[str, tuple[float, float, float]] = {
    "h100": (989e12, 450e9, 50e9),
    "h200": (989e12, 450e9, 50e9),
    "a100": (312e12, 300e9, 25e9),
}
GEMM_EFFICIENCY = 0.75
HBM_BYTES_PER_S = {"h100": 3.35e12, "h200": 4.8e12, "a100": 2.04e12}


def model_flops_per_token(model, seq_len: int) -> tuple[float, float]:
    """(matmul FLOPs per token of forward + backward, of which attention's S x S part)."""
    from fsdp_jax.app.models.llama import count_params

    d, v = model.d_model, model.vocab_size
    # the embedding lookup does no matmul; a tied head multiplies by the same table; a
    # mixture of experts multiplies each token by its top-k experts only (active params)
    matmul = count_params(model, active=True) - (0 if model.tie_word_embeddings else v * d)
    attn = 12 * model.n_layers * model.n_heads * model.head_dim * seq_len
    return 6 * matmul + attn, attn


def peaks(target: str) -> tuple[float, float, float | None, float]:
    """(dense bf16 FLOP/s, fast-link bytes/s sent per device, slow-network bytes/s per
    device or None, HBM bytes/s) of one device of `target`: a GPU in SPECS (NVLink within a
    host, the NIC across hosts) or a TPU generation (ICI within a slice, the data-center
    network across slices; `fsdp_jax.targets.tpu.device_peaks`, the Cloud TPU pages' figures)."""
    if target in SPECS:
        return (*SPECS[target], HBM_BYTES_PER_S[target])
    from fsdp_jax.targets.tpu import device_peaks

    p = device_peaks(target)
    return p["flops"], p["fast"], p["slow"], p["hbm"]


def predict(cfg, target: str, n_devices: int, result: dict[str, Any]) -> dict[str, Any] | None:
    """Predicted step time, tokens/s per device (GPU or TPU chip; a v4 core), TFLOP/s per
    device and MFU for one strategy's planner result on `target` (a name in SPECS or a TPU
    generation). None when the program crosses a network whose bandwidth is unpublished
    (v4 and v6e slices over the data-center network)."""
    peak, nvlink, net, hbm = peaks(target)
    seq, batch = cfg.data.seq_len, cfg.train.global_batch
    tokens = seq * batch / n_devices  # per device per step
    per_token, attn = model_flops_per_token(cfg.model, seq)
    recompute = {"full": (per_token - attn) / 3 + attn / 3}.get(cfg.remat, 0.0)  # one more forward
    compute_s = tokens * (per_token + recompute) / (peak * GEMM_EFFICIENCY)
    com = result.get("communication") or {}
    total = com.get("total_wire_bytes", 0)
    cross = sum(e.get("cross_host_wire_bytes", 0) for e in com.values() if isinstance(e, dict))
    if cross and net is None:
        return None
    comm_s = (total - cross) / nvlink + (cross / net if cross else 0.0)
    # the update reads grads, params and optimizer state and writes params and state
    a = result["analytic"]
    update_s = (a["grads"] + 2 * (a["params"] + a["optimizer"])) / hbm
    step_s = max(compute_s, comm_s) + update_s
    model_flops = tokens * per_token
    g = lambda x: float(f"{x:.4g}")  # noqa: E731  (4 significant digits: tiny test steps too)
    return {
        "step_s": g(step_s),
        "tokens_per_s_per_gpu": g(tokens / step_s),
        "tflops_per_gpu": g(model_flops / step_s / 1e12),
        "mfu": g(model_flops / step_s / peak),
        "compute_s": g(compute_s),
        "comm_s": g(comm_s),
        "update_s": g(update_s),
        "bound": "compute" if compute_s >= comm_s else "communication",
    }


def format_predictions(doc: dict[str, Any]) -> list[str]:
    """Lines for the planner's table (empty when no strategy has a prediction)."""
    rows = [(n, r["predicted"]) for n, r in doc["strategies"].items() if r.get("predicted")]
    if not rows:
        return []
    lines = [
        "",
        f"predicted step time (roofline over the compiled program's traffic; compute at "
        f"{GEMM_EFFICIENCY:.0%} of the dense bf16 peak; fsdp_jax.app.planner.step_time):",
    ]
    per = "dev" if (doc.get("target") or {}).get("topology_name") else "GPU"  # a TPU chip (v4: core)
    hdr = (
        f"{'strategy':<14}{'step s':>9}{'compute':>9}{'comm':>9}{'update':>9}{'tok/s/' + per:>11}"
        f"{'TFLOP/s':>9}{'MFU':>7}  bound"
    )
    lines += [hdr, "-" * len(hdr)]
    for n, p in rows:
        lines.append(
            f"{n:<14}{p['step_s']:9.3f}{p['compute_s']:9.3f}{p['comm_s']:9.3f}{p['update_s']:9.3f}"
            f"{p['tokens_per_s_per_gpu']:11,.0f}{p['tflops_per_gpu']:9.1f}{p['mfu']:7.1%}  {p['bound']}"
        )
    return lines
