"""plan --search with a `lora:` section: every candidate is the trainer's LoRA step (the base
frozen at its dtype, optimizer state for the adapters only, no gradient traffic for the
base), and the search reports its winner as LoRA."""

import dataclasses
from pathlib import Path

import pytest
import yaml

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.models.decoder import count_params
from fsdp_jax.app.planner import search as se
from fsdp_jax.app.planner.search_prediction import analytic_communication
from fsdp_jax.app.planner.search_report import format_search, winner_yaml
from fsdp_jax.app.planner.search_space import candidate_config
from fsdp_jax.targets.plugins import INSTALL_HINT
from helpers import call

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
# configs/tiny.yaml's model (d 256, ffn 704, 4 layers: rank 16 adapters are 10% of a layer), bf16 compute
BASE = ["train.steps=10", "precision=params=float32,compute=bfloat16"]
LORA = ["lora.rank=16", "lora.alpha=32"]
GRID = se.SearchSpace(
    strategies=("no_shard", "shard_opt", "shard_grad_op", "full_shard"),
    remats=("none", "full"),
    microbatches=(1, 2),
    offloads=("none",),
)


def searched(extra, space=GRID, **limits):
    cfg = load_config(TINY_YAML, BASE + extra)
    doc = se.search(cfg, 8, space, se.Limits(**{"device_memory": 10**12, "max_compiles": 0, **limits}))
    return cfg, {tuple(c["overrides"]): c for c in doc["candidates"]}, doc


def test_every_candidate_is_the_lora_step_frozen_base_at_its_dtype_adapters_only_optimizer():
    cfg, lora, doc = searched(LORA)
    _, full, full_doc = searched([])
    assert set(lora) == set(full) and len(lora) == len(GRID.strategies) * 2 * 2
    adapter_bytes = 4 * lora_lib.adapter_param_count(cfg.model, lora_lib.spec_from_config(cfg.lora))  # f32
    for key, c in lora.items():
        a, f = c["analytic"], full[key]["analytic"]
        assert a["device_total"] < f["device_total"], key
        # the base rests in bf16 (no f32 master copy): half the full run's f32 params, sharded alike;
        # the rest is the adapters (f32), between a 1/8 shard and a replica of them per device
        adapters_here = a["params"] - f["params"] / 2
        assert adapter_bytes / 8 <= adapters_here <= adapter_bytes, key
        assert a["trainable"] == adapters_here, key
        # Adam's two moments of the adapters, nothing for the base (counters aside); laid out as
        # the params but under shard_opt (ZeRO-1: replicated params, sharded state)
        assert 2 * adapter_bytes / 8 <= a["optimizer"] - 12 <= 2 * adapter_bytes, key
        if "mesh.strategy=shard_opt" not in key:
            assert abs(a["optimizer"] - 2 * a["trainable"]) <= 64, key
        assert a["grads"] <= 2 * a["trainable"] and a["grads"] < f["grads"], key  # grads (+ accumulator): adapters
        assert c["predicted"]["compute_s"] < full[key]["predicted"]["compute_s"]  # 4 FLOPs per frozen param, not 6
    assert doc["lora"] == {
        "rank": 16,
        "alpha": 32.0,
        "rslora": False,
        "dropout": 0.0,
        "targets": "all-linear",
        "adapter_params": adapter_bytes // 4,
        "base_dtype": "bfloat16",
    }
    assert full_doc["lora"] is None


def test_the_winner_is_reported_as_lora_and_its_yaml_carries_the_lora_section(capsys):
    """A budget the full fine-tuning of this model fits in nowhere: the LoRA search has a winner,
    the table and the YAML say it is LoRA."""
    _, full, _ = searched([])
    least_full = min(c["analytic"]["device_total"] for c in full.values())
    mem = f"{least_full * 0.95 / 1e6:.2f}MB"  # headroom 0: the budget is the device memory
    args = ["--config", TINY_YAML, "--devices", "8", "--device-memory", mem, "--search", "--headroom", "0"]
    args += ["--max-compiles", "0", "--offload", "none", *BASE]
    rc, _, err = call("plan.py", *args, capsys=capsys)
    assert rc == 2 and "none of" in err  # without LoRA nothing fits
    rc, out, err = call("plan.py", *args, *LORA, capsys=capsys)
    assert rc == 0, err
    assert "LoRA rank 16 (all-linear): 315,392 adapter params train" in out and "frozen at bfloat16" in out
    assert "winner (LoRA rank 16): mesh.strategy=" in out
    snippet = yaml.safe_load(out.split("as YAML (paste into the config):\n", 1)[1])
    assert snippet["lora"] == {"rank": 16, "alpha": 32.0, "rslora": False, "dropout": 0.0, "targets": "all-linear"}
    assert "strategy" in snippet["mesh"] and "remat" in snippet
    _, _, doc = searched(LORA, device_memory=int(least_full * 0.95), headroom_fraction=None)
    assert doc["winner"] is not None and format_search(doc).count("LoRA rank 16") == 2
    assert yaml.safe_load(winner_yaml(doc))["lora"]["rank"] == 16


def test_lora_communication_by_hand():
    """P: the base's params, G: the adapters', both bf16; per device per step: DDP
    2G(N-1)/N, ZeRO-1 3G(N-1)/N, ZeRO-2 M(P + G)(F-1)/F, ZeRO-3 M(2P + G)(F-1)/F, HSDP plus
    2(G/F)(D-1)/D across data. The base sends no gradient: DDP's traffic is the adapters'."""
    cfg = load_config(TINY_YAML, BASE + LORA)
    adapters = lora_lib.adapter_param_count(cfg.model, lora_lib.spec_from_config(cfg.lora))
    p, g, f = 2 * count_params(cfg.model), 2 * adapters, 7 / 8
    wire = lambda c, s, sizes=(1, 8, 1), hosts=1: analytic_communication(c, s, sizes, hosts)["total_wire_bytes"]  # noqa: E731
    assert wire(cfg, "no_shard", (8, 1, 1)) == int(2 * g * f)
    assert wire(cfg, "shard_opt") == int(3 * g * f)
    assert wire(cfg, "shard_grad_op") == int((p + g) * f)
    assert wire(cfg, "full_shard") == int((2 * p + g) * f)
    two = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=2))
    assert wire(two, "full_shard") == int(2 * (2 * p + g) * f)
    assert wire(cfg, "hybrid_shard", (2, 4, 1), 2) == int((2 * p + g) * 3 / 4 + 2 * g / 4 * 0.5)
    full = load_config(TINY_YAML, BASE)
    assert wire(cfg, "no_shard", (8, 1, 1)) < 0.12 * wire(full, "no_shard", (8, 1, 1))


@pytest.mark.slow
def test_lora_communication_tracks_the_gpu_compile():
    """On 8 x H100 (XLA:GPU, compile only): ZeRO-3's all-gathers are the base twice (within 2%:
    the adapters, mostly replicated, add little), and DDP's traffic is the adapters' gradients (the full-training formula would
    be 10x over), within the factor 2 f32 gradients of this tiny model cost."""
    from fsdp_jax.app.planner.search_compile import compile_candidates
    from fsdp_jax.targets import gpu as targets

    assert targets.plugin_installed(), f"run `{INSTALL_HINT}` (the CUDA compile-only plugin)"
    space = se.SearchSpace(
        strategies=("no_shard", "full_shard"), remats=("full",), microbatches=(1,), offloads=("none",)
    )
    cfg, cands, _ = searched(LORA, space)
    cands = list(cands.values())
    results = compile_candidates(cfg, 8, cands, targets.make_target("h100", 8), progress=lambda m: None)
    for c, r in zip(cands, results):
        ccfg, sizes = candidate_config(cfg, c), tuple(c["mesh"].values())
        analytic, compiled = (
            analytic_communication(ccfg, c["strategy"], sizes, 1)["total_wire_bytes"],
            r["communication"],
        )
        if c["strategy"] == "full_shard":
            gathers = 2 * 2 * count_params(cfg.model) * 7 / 8
            assert abs(compiled["all-gather"]["wire_bytes"] / gathers - 1) < 0.02
        else:
            assert 1.0 <= compiled["total_wire_bytes"] / analytic <= 2.05, (compiled, analytic)


def test_llama2_70b_on_one_8_x_h100_node_fits_on_the_devices_with_lora_only():
    """Issue 40's case, by the analytic model on the H100 target (no compile): without LoRA no
    candidate without host offload fits the device memory; with rank-16 adapters several do."""
    from fsdp_jax.targets import gpu as targets

    space = se.SearchSpace(
        strategies=("full_shard", "shard_grad_op"),
        remats=("full", "save_attn_mlp_out", "dots"),
        microbatches=(1, 2),
        offloads=("none",),
    )
    target = targets.make_target("h100", devices=8)
    docs = {}
    for name, extra in (("full", []), ("lora", ["lora.rank=16"])):
        cfg = load_config(
            ROOT / "configs" / "llama2_70b.yaml", ["model.attention=cudnn", "train.global_batch=8", *extra]
        )
        limits = se.Limits(device_memory=targets.device_memory("h100"), max_compiles=0)
        docs[name] = se.search(cfg, 8, space, limits, target=target)
    assert docs["full"]["winner"] is None and docs["full"]["counts"]["fits"] == 0
    assert docs["full"]["smallest_fitting_memory"] > 100e9
    w = docs["lora"]["winner"]
    assert w is not None and w["analytic"]["device_total"] <= docs["lora"]["budget"]
    assert docs["lora"]["lora"]["rank"] == 16 and docs["lora"]["lora"]["base_dtype"] == "bfloat16"
