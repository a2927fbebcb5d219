"""Published training runs the step-time model is held against (BENCHMARKS.md, docs/step_time.md).

    for run in PUBLISHED_RUNS: print(run.name, plan_command(run))
    got = predicted_value(run, cfg, doc)       # doc: `plan --json` for plan_command(run)
    err = got / run.published - 1

Each run is data: what was published (value, unit, where), the nearest plan of this project
(config, target, devices, hosts, strategy, overrides) and the table it is costed with
(`cost_target`, a key of `fsdp_jax/targets/perf_tables.json`: the target's own, a cluster's
network included, as `plan --target` costs it), and its role: `fit` (a table
constant was fitted to it), `check` (held out), `bound` (another framework on other
hardware: the prediction should be at least the published figure, not equal to it).
One `fit` row per fitted constant: the GPU GEMM efficiency (MaxText 7B on 1 x A3) and the TPU
one of the generations without a published figure (MaxText 70B on v5p; v6e's is a published
measurement); every other row is held out. The model is held to TOLERANCE on every
`fit` and `check` row.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from fsdp_jax.app.models.decoder import count_params
from fsdp_jax.app.planner.step_time import predict_ops

TOLERANCE = 0.15
MAXTEXT_A3 = "AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md (TFLOP/sec/chip) and {}vm.sh"
_7B_A3 = ("train.global_batch={}", "remat=dots_no_batch", "model.attention=cudnn")


@dataclasses.dataclass(frozen=True)
class PublishedRun:
    name: str
    source: str
    published: float
    unit: str  # "maxtext_tflops" (their count: 6 x params + 12 L d S per token) or "tokens_per_s"
    role: str  # fit | check | bound
    config: str
    target: str
    devices: int
    hosts: int
    strategy: str
    overrides: tuple[str, ...]
    cost_target: str
    tpu_flags: str | None = None  # a libtpu flag set of fsdp_jax/targets/tpu_flags.json (`plan --tpu-flags`)


def _a3(nodes: int, role: str, published: float) -> PublishedRun:
    return PublishedRun(
        name=f"MaxText Llama-2-7B, {nodes} x A3 (8 x H100), FSDP 8"
        + (f" x DP {nodes} across hosts" if nodes > 1 else ""),
        source=MAXTEXT_A3.format(nodes),
        published=published,
        unit="maxtext_tflops",
        role=role,
        config="configs/llama2_7b.yaml",
        target="a3-high",
        devices=8 * nodes,
        hosts=nodes,
        strategy="full_shard" if nodes == 1 else "hybrid_shard",
        overrides=tuple(o.format(32 * nodes) for o in _7B_A3),
        cost_target="a3-high",
    )


PUBLISHED_RUNS: tuple[PublishedRun, ...] = (
    _a3(1, "fit", 492.0),
    _a3(2, "check", 422.0),
    _a3(4, "check", 407.0),
    _a3(8, "check", 409.0),
    _a3(16, "check", 375.0),
    PublishedRun(
        name="MaxText Llama-2-70B, v5p (256 chips here, 512 published), FSDP, batch 4/chip, seq 4096, splash",
        source=(
            "MaxText docs/reference/models/tiering.md (v5p, Llama 2 70B, 512 chips, 65.4% MFU, ~692 tokens/s/device); "
            "config benchmarks/maxtext_v5p_model_configs.py llama2_70b_v5p_128 (ici_fsdp_parallelism -1, "
            "per_device_batch_size 4, remat_policy save_dot_except_mlpwi). Compiled for 256 chips: at a fixed "
            "batch per chip FSDP's traffic per chip is (n-1)/n of the params, 255/256 vs 511/512"
        ),
        published=692.0,
        unit="tokens_per_s",
        role="fit",
        config="configs/llama2_70b.yaml",
        target="v5p-512",
        devices=256,
        hosts=1,
        strategy="full_shard",
        overrides=("train.global_batch=1024", "remat=save_qkv_attn_mlp_out", "model.attention=splash"),
        cost_target="v5p",
        tpu_flags="maxtext-llama2-70b-v5p",
    ),
    PublishedRun(
        name="MaxText Llama-2-70B, v6e-256, FSDP 256, batch 4/chip (2 x 2 here), seq 4096, remat full, splash",
        source=(
            "MaxText docs/reference/models/tiering.md (Trillium, Llama 2 70B, 256 chips, 43.8% MFU, ~900 "
            "tokens/s/device); config benchmarks/maxtext_trillium_model_configs.py llama2_70b_4096 "
            "(per_device_batch_size 4, ici_fsdp_transpose_parallelism -1, remat_policy full, attention flash); "
            "its tpu-recipes log (training/trillium/Llama2-70B-MaxText) shows 943 tokens/s/device. Here in 2 "
            "microbatches of 2: in one, XLA:TPU refuses the step (33.94 GB of temporaries for 33.55)"
        ),
        published=900.0,
        unit="tokens_per_s",
        role="check",
        config="configs/llama2_70b.yaml",
        target="v6e-256",
        devices=256,
        hosts=1,
        strategy="full_shard",
        overrides=("train.global_batch=1024", "train.microbatches=2", "remat=full", "model.attention=splash"),
        cost_target="v6e",
        tpu_flags="maxtext-llama2-70b-v6e",
    ),
    PublishedRun(
        name="torchtitan Llama-3.1-8B, 8 x H100 (500 W, HBM2e), FSDP 8, seq 8192, compiled",
        source="pytorch/torchtitan benchmarks/llama3_h100_202412_torchtitan.md, Table 1 (FSDP + torch.compile)",
        published=6667.0,
        unit="tokens_per_s",
        role="bound",
        config="configs/llama3_1_8b.yaml",
        target="h100",
        devices=8,
        hosts=1,
        strategy="full_shard",
        overrides=("train.global_batch=16", "data.seq_len=8192", "remat=dots_no_batch", "model.attention=cudnn"),
        cost_target="h100",
    ),
)


def plan_command(run: PublishedRun) -> str:
    """The `plan` command whose JSON `predicted_value` reads."""
    where = f"--target {run.target}" + ("" if run.target.startswith("v") else f" --devices {run.devices}")
    where += f" --hosts {run.hosts}" if run.hosts > 1 else ""
    where += f" --tpu-flags {run.tpu_flags}" if run.tpu_flags else ""
    return f"python scripts/plan.py --config {run.config} {where} --strategies {run.strategy} --json " + " ".join(
        run.overrides
    )


def predicted_value(run: PublishedRun, cfg, result: dict[str, Any], n_devices: int) -> float:
    """The prediction for `run` in its published unit, from one strategy's planner result
    (with its `op_inventory`), costed with `run.cost_target`'s table."""

    p = predict_ops(cfg, run.cost_target, n_devices, result)
    if p is None:
        raise ValueError(f"{run.name}: no prediction (a network without published bandwidth)")
    if run.unit == "tokens_per_s":
        return p["tokens_per_s_per_gpu"]
    m = cfg.model
    per_token = 6 * count_params(m) + 12 * m.n_layers * m.d_model * cfg.data.seq_len
    return p["tokens_per_s_per_gpu"] * per_token / 1e12
