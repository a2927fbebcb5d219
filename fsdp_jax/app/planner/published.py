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
from fsdp_jax.app.planner.search_prediction import analytic_communication
from fsdp_jax.app.planner.step_time import predict_ops, predict_roofline

TOLERANCE = 0.15
MAXTEXT_A3 = "AI-Hypercomputer/maxtext MaxText/configs/a3/llama_2_7b/README.md (TFLOP/sec/chip) and {}vm.sh"
MAXTEXT = "https://github.com/AI-Hypercomputer/maxtext/blob/"
A3_URL = MAXTEXT + "d2aa7f25f6e017c63610f5964f836ff7311ca4b5/MaxText/configs/a3/llama_2_7b/README.md"
TIERING_2025 = MAXTEXT + "20a91e12a17cbaa7b786ac388b192b63392cd855/docs/reference/models/tiering.md"
TIERING_2026 = MAXTEXT + "e591f30cbbf217ed67ef71263ec0538239f9c3b8/docs/reference/models/tiering.md"
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
    url: str = ""  # where the figure is published, at a fixed commit
    date: str = ""  # of that commit (the figure was published on or before it)


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
        url=A3_URL,
        date="2024-04-16",
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
        url=TIERING_2025,
        date="2025-11-24",
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
        url=TIERING_2025,
        date="2025-11-24",
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
        url="https://github.com/pytorch/torchtitan/blob/main/benchmarks/llama3_h100_202412_torchtitan.md",
        date="2024-12",
    ),
    # held out, added after the constants above were fixed (issue 56): compute unlike rows 0-6
    # (another model, sequence length, batch per chip, a mixture of experts), scored as they are
    PublishedRun(
        name="MaxText Llama-3.1-8B, v6e-256, FSDP 256, batch 4/chip (2 x 2 here), seq 8192, splash, "
        "activations offloaded",
        source=(
            "MaxText docs/reference/models/tiering.md (Trillium Gold, Llama 3.1 8B, 256 chips, BF16, SL=8192, "
            "45.46% MFU, 7,207 tokens/s/device); config benchmarks/maxtext_trillium_model_configs.py "
            "llama3_1_8b_8192 (per_device_batch_size 4, ici_fsdp_parallelism -1, remat_policy custom: decoder "
            "layer input and q/k/v/out projections offloaded to host, attention flash). Here the nearest "
            "policy offloads q/k/v, the attention output and the MLP output; in one microbatch of 4 XLA:TPU "
            "refuses the step (36.26 GB of temporaries for 33.55), so 2 microbatches of 2"
        ),
        published=7207.0,
        unit="tokens_per_s",
        role="check",
        config="configs/llama3_1_8b.yaml",
        target="v6e-256",
        devices=256,
        hosts=1,
        strategy="full_shard",
        overrides=(
            "train.global_batch=1024",
            "train.microbatches=2",
            "data.seq_len=8192",
            "remat=offload_qkv_attn_mlp_out",
            "model.attention=splash",
        ),
        cost_target="v6e",
        tpu_flags="maxtext-llama3_1-8b-v6e",
        url=TIERING_2026,
        date="2026-08-22",
    ),
    PublishedRun(
        name="MaxText Mixtral-8x7B, v5p-256 (128 chips), FSDP 128, batch 36/chip (2 x 18 here), seq 4096, "
        "dropless MoE, remat full, splash",
        source=(
            "MaxText docs/reference/models/tiering.md (v5p Silver, Mixtral 8X7B, 256 Chips(8x4x4), bf16, "
            "SL=4096, 52.56% MFU, 2,909 tokens/s/device); recipe AI-Hypercomputer/tpu-recipes "
            "training/v5p/Mixtral-8X7B-Maxtext (per_device_batch_size 36, bf16 weights, attention flash, "
            "base.yml's remat full, megablox dropless). Its libtpu flags are not applied here (not read). "
            "In one microbatch of 36 the step compiles to 144.5 GB per chip (BENCHMARKS.md), so 2 of 18"
        ),
        published=2909.0,
        unit="tokens_per_s",
        role="check",
        config="configs/mixtral_8x7b.yaml",
        target="v5p-256",
        devices=128,
        hosts=1,
        strategy="full_shard",
        overrides=(
            "train.global_batch=4608",
            "train.microbatches=2",
            "precision=params=bfloat16,compute=bfloat16",
            "model.attention=splash",
        ),
        cost_target="v5p",
        url=TIERING_2026,
        date="2026-08-22",
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


def prediction(run: PublishedRun, cfg, result: dict[str, Any], n_devices: int) -> dict[str, Any] | None:
    """One strategy's planner result costed with `run.cost_target`'s table: its compiled
    program op by op, or where the compiler refused it (no program) the roofline over the
    analytic traffic, as `plan` prints it (`predict_roofline`, basis said)."""
    if result.get("op_inventory"):
        return predict_ops(cfg, run.cost_target, n_devices, result)
    m = result["mesh"]
    comm = analytic_communication(cfg, run.strategy, (m["data"], m["fsdp"], m["tensor"]), run.hosts, run.cost_target)
    p = predict_roofline(cfg, run.cost_target, n_devices, {"analytic": result["analytic"], "communication": comm})
    return p and {**p, "basis": "roofline over the analytic traffic: the compiler refused the program"}


def predicted_value(run: PublishedRun, cfg, result: dict[str, Any], n_devices: int) -> float:
    """The prediction for `run` in its published unit, from one strategy's planner result:
    its `op_inventory` costed with `run.cost_target`'s table, or where the compiler refused the
    program (no inventory) the plan's own roofline prediction."""

    p = prediction(run, cfg, result, n_devices)
    if p is None:
        raise ValueError(f"{run.name}: no prediction (a network without published bandwidth)")
    if run.unit == "tokens_per_s":
        return p["tokens_per_s_per_gpu"]
    m = cfg.model
    per_token = 6 * count_params(m) + 12 * m.n_layers * m.d_model * cfg.data.seq_len
    return p["tokens_per_s_per_gpu"] * per_token / 1e12
