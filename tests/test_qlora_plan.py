"""The planner's memory model for a quantised LoRA base (`lora.base_quant`), held to the
compiled step's memory_analysis() on the H100 compile-only target, and the PCIe GPU targets
QLoRA is planned on.

The model counts the base as what the step holds: NF4 codes (half a byte a weight) and the
absmax bits as params, layers of codes gathered in flight, and one layer dequantised in the
compute dtype inside the layer (an upper bound: XLA:GPU reuses the buffers of a layer's
dequantised matrices, so less of it is live at once). The model here is wide and short
(d_model 512, 2 layers, 32 tokens a device) so that the weights, not the activations, make
the peak. (XLA:CPU is no reference for this: it upcasts a bf16 frozen base to float32 for its
dots, a whole-stack copy no GPU compile makes.)"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import jax
import numpy as np
import pytest

from fsdp_jax.app.planner import gathered_memory, memory_model
from fsdp_jax.app.planner.abstract_step import build_step
from fsdp_jax.app.planner.memory_model import analytic_memory, argument_bytes
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.sharding import frozen_rows
from fsdp_jax.targets import gpu as targets
from fsdp_jax.targets.perf_tables import perf_table
from helpers import call, plans_in_one_child

# jax 0.12's XLA:GPU programs that the QLoRA memory model is not fitted to yet (BENCHMARKS.md, 2026-12-07
# eighth session): no_shard's analytic peak 0.9294 of the H100 compile (the floor is 0.93), and the
# 70B step's transient bytes 705,464,656 over the RTX 4090 compile's temp (the bound is the 524,288,000
# of the gathered head). At the planned 80-layer rows the model is 0.6-1.6% over every 0.12 compile;
# the 2-layer program's buffer reuse differs (docs/qlora.md, the jax 0.12 table, 2026-12-08).
# Strict: a fit that brings either inside fails here until the mark goes.
NOT_FITTED_TO_JAX_0_12 = pytest.mark.xfail(
    jax.__version_info__ >= (0, 12), reason="QLoRA memory model not fitted to jax 0.12's XLA:GPU", strict=True
)

ROOT = Path(__file__).resolve().parents[1]
MODEL = [
    "model.d_model=512",
    "model.n_heads=4",
    "model.n_kv_heads=4",
    "model.ffn_dim=1024",
    "model.n_layers=2",
    "model.vocab_size=256",
    "model.max_seq_len=32",
    "data.seq_len=32",
    "train.global_batch=8",
    "lora.rank=4",
    "data.source=none",
    "precision=params=float32,compute=bfloat16",
]
LAYER_WEIGHTS = 4 * 512 * 512 + 3 * 512 * 1024  # wq wk wv wo + gate up down, one layer
STRATEGIES = ("full_shard", "shard_grad_op", "no_shard")
HEADS8 = ("model.n_heads=8", "model.n_kv_heads=8")  # heads divisible by the 8 devices (wo's codes shard on them)


def config(*extra):
    return load_run_config(ROOT / "configs" / "tiny.yaml", MODEL + list(extra))


def test_the_analytic_model_counts_codes_and_one_dequantised_layer():
    """No compile: the NF4 base is 0.5625 bytes a weight at rest (codes + float32 absmax per
    64), and full_shard's gathered term is two layers of codes plus one layer in bf16 where a
    bf16 base has two bf16 layers."""
    a = {
        base: analytic_memory(build_step(config(*extra, *HEADS8), "full_shard"))
        for base, extra in (("nf4", ["lora.base_quant=nf4"]), ("bf16", []))
    }
    n = 2 * LAYER_WEIGHTS
    # every base leaf here shards over the 8 devices (8 heads: wo's frozen_rows dim divides them)
    saved = a["bf16"]["params"] - a["nf4"]["params"]
    assert saved == (2 - 0.5625) * n / 8, saved
    expected = 2 * 2 * LAYER_WEIGHTS - 2 * 0.5625 * LAYER_WEIGHTS - 2 * LAYER_WEIGHTS
    got = a["bf16"]["gathered"] - a["nf4"]["gathered"]
    assert got == expected, (got, expected)


def test_the_trained_adapters_count_per_layer_not_as_unstacked_leaves():
    """The trained leaves only (`_only` trees, None where frozen): each adapter leaf is a layer's
    stacked leaf, so one layer's unreduced grads are its adapters' (the larger of these and the
    layer gathered, on GPU) and none is an unstacked leaf held through the layer loop. Names and
    rows were misaligned once (the frozen leaves' None names kept, their rows dropped): every
    adapter counted as unstacked, all layers' adapter grads held at once (+0.83 GB on the 70B
    QLoRA plan for 2 x RTX 4090, 2026-12-07)."""
    b = build_step(config(*HEADS8, "lora.base_quant=nf4"), "full_shard")
    keep = memory_model._trainable(b)
    assert 0 < sum(keep) < len(keep)
    trained = gathered_memory.compute_copy_bytes(
        gathered_memory._only(b.state.params, keep),
        b.plan,
        gathered_memory._only(b.model.logical_axes, keep),
        "float32",
    )
    n_layers = b.cfg.model.n_layers
    assert trained["unstacked"] == 0 and trained["layer"] > 0, trained
    assert trained["whole"] == n_layers * trained["layer"], trained


def _h100_args(*args, overrides=()):
    """`--target h100 --devices 8 <args> --json` of the NF4 model (a command's flags)."""
    nf4 = [*MODEL, "lora.base_quant=nf4", *overrides]
    return ["--config", "configs/tiny.yaml", "--target", "h100", "--devices", "8", *args, "--json", *nf4]


def test_frozen_w_down_and_wo_shard_over_fsdp_on_their_leading_dim(monkeypatch):
    """No compile: the weights whose fsdp dim is their last (`w_down` (mlp, embed), `wo`
    (heads, kv, embed)) keep their codes and absmax sharded over fsdp on their leading own dim
    (`frozen_rows`), so each layer's gather runs along a major dim; the others as their weight."""
    st = build_step(config("lora.base_quant=nf4", "lora.double_quant=true", *HEADS8), "full_shard").state
    base = st.params["blocks"]
    specs = {
        f"{m}/{w}/{k}": tuple(v.sharding.spec)
        for m, ws in (("attn", ("wq", "wo")), ("mlp", ("w_up", "w_down")))
        for w in ws
        for k, v in base[m][w].items()
    }
    assert specs["mlp/w_down/codes"] == specs["mlp/w_down/absmax_codes"] == (None, "fsdp", None)
    assert specs["attn/wo/codes"] == specs["attn/wo/absmax_codes"] == (None, "fsdp", None, None)
    assert specs["mlp/w_up/codes"] == (None, "fsdp", None) and specs["attn/wq/codes"][:2] == (None, "fsdp")
    assert specs["mlp/w_down/absmax2"] == specs["mlp/w_down/offset"][:1] + (None,)
    # a float LoRA base alike (`fsdp_jax.sharding.frozen_rows`) for weights of at least MIN_ELEMENTS a layer
    monkeypatch.setattr(frozen_rows, "MIN_ELEMENTS", 1)
    plain = build_step(config(*HEADS8), "full_shard").state.params["blocks"]
    assert tuple(plain["mlp"]["w_down"].sharding.spec) == (None, "fsdp", None)
    assert tuple(plain["attn"]["wo"].sharding.spec) == (None, "fsdp", None, None)
    assert tuple(plain["mlp"]["w_up"].sharding.spec) == (None, "fsdp", None)
    monkeypatch.undo()  # this config's weights are smaller than that: they keep their trained names
    small = build_step(config(*HEADS8), "full_shard").state.params["blocks"]
    assert tuple(small["mlp"]["w_down"].sharding.spec)[-1] == "fsdp"


@pytest.fixture(scope="module")
def gpu_plans():
    """The module's two `plan --json` documents on GPU targets, in one child (helpers.plans_in_one_child:
    one Python, JAX and plugin start-up, where each plan paid its script's and its compile child's):
    the NF4 model's three strategies on 8 x H100, and the 2-layer 70B QLoRA full_shard step on
    2 x RTX 4090."""
    assert targets.plugin_installed(), "run `python -m fsdp_jax.targets install` (the CUDA compile-only plugin)"
    runs = [
        _h100_args("--strategies", ",".join(STRATEGIES)),
        ["--config", "configs/llama2_70b.yaml", "--target", "rtx4090", "--devices", "2"]
        + ["--strategies", "full_shard", "--json", *QLORA_70B],
    ]
    ts = [targets.make_target("h100", devices=8), targets.make_target("rtx4090", devices=2)]
    docs = []
    for argv, (rc, out, err) in zip(runs, plans_in_one_child(ts, runs), strict=True):
        assert rc == 0, (argv, err[-2000:])
        docs.append(json.loads(out))
    return docs


@pytest.fixture(scope="module")
def h100_plan(gpu_plans):
    return gpu_plans[0]["strategies"]


def _relaid_stacks(hlo: str, n_layers: int) -> set[str]:
    """Integer arrays of the layer stack (leading dim `n_layers`, rank >= 3) that the compiled
    program holds in a layout other than the default (dims major to minor in order): a stack
    of codes copied into another layout."""
    found = set()
    for m in re.finditer(r"\b([us]\d+)\[([\d,]+)\]\{([\d,]+)\}", hlo):
        shape, layout = [int(x) for x in m.group(2).split(",")], [int(x) for x in m.group(3).split(",")]
        if len(shape) >= 3 and shape[0] == n_layers and layout != sorted(layout, reverse=True):
            found.add(m.group(0))
    return found


@pytest.mark.slow
def test_h100_layer_gathers_move_codes_and_no_base_gradient(tmp_path, capsys):
    """XLA:GPU (H100, compile only), full_shard: each layer's all-gather, forward and backward,
    moves the NF4 codes (u8) and absmax bits (u32): 0.28x the bytes of the bf16 layer (0.5 +
    4/64 bytes a weight against 2), plus the adapters in bf16; nothing else gathers or
    reduces a weight-sized tensor (no gradient of the base: the reductions are the adapters').
    No stack of codes is held in another layout: with `w_down`'s and `wo`'s codes sharded on
    their last dim, XLA:GPU copied both whole stacks, transposed, before the layer loop."""
    # in process (its compile child is the only one), XLA's HLO dump in that child's environment
    dump = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={tmp_path}".strip()}
    args = _h100_args("--strategy", "full_shard", overrides=HEADS8)
    rc, out, err = call("inspect", *args, capsys=capsys, env=dump)
    assert rc == 0, err[-2000:]
    sched = json.loads(out)["schedule"]
    (hlo,) = tmp_path.glob("*jit_step*gpu_after_optimizations.txt")
    assert not _relaid_stacks(hlo.read_text(), 2)
    gathers = [c for c in sched if c["op"] == "all-gather" and c["loop"]]
    assert {c["phase"] for c in gathers} == {"forward", "backward"}
    bf16_layer = 2 * LAYER_WEIGHTS
    adapters = 2 * 4 * (4 * (512 + 512) + 2 * (512 + 1024) + (1024 + 512))  # bf16 A and B of the 7 targets
    for c in gathers:
        codes = c["dtypes"].get("u8", 0) + c["dtypes"].get("u32", 0)
        assert codes / bf16_layer == 0.5625 / 2, c["dtypes"]
        assert c["runs"] == 2 and c["bytes"] - codes <= adapters, c["dtypes"]  # once per layer
    reductions = [c for c in sched if c["op"] in ("reduce-scatter", "all-reduce")]
    assert reductions and all(set(c["dtypes"]) == {"float32"} for c in reductions)
    assert sum(c["bytes"] for c in reductions) <= 4 * adapters // 2  # float32 grads of the adapters


@pytest.mark.slow
@NOT_FITTED_TO_JAX_0_12
def test_the_model_holds_to_the_h100_compile(h100_plan):
    """XLA:GPU (H100, compile only): the arguments are exactly the codes, absmax bits,
    adapters, their optimizer state and the batch; the analytic peak is within 30% of the
    compiled one and never more than 7% under it (counting the codes as bf16 values and no
    dequantised layer, as before, it was 4-7% under on every strategy, and its gathered term
    fell short of what shard_grad_op holds)."""
    for s in STRATEGIES:
        a, c = h100_plan[s]["analytic"], h100_plan[s]["compiled"]
        assert c["argument"] == argument_bytes(a), s
        ratio = a["total"] / c["peak"]
        assert 0.93 <= ratio <= 1.30, (s, ratio)
    # what the step holds besides the state and the activations (gathers, dequantised
    # weights, the adapters' grads) is covered by the model where the params are gathered
    for s in ("full_shard", "shard_grad_op"):
        a, c = h100_plan[s]["analytic"], h100_plan[s]["compiled"]
        assert c["temp"] - a["activations"] - a["grads"] <= a["gathered"], s


def test_pcie_targets_are_sourced_tables():
    """The consumer / mid-range cards: memory from the target file, peaks and links from
    perf_tables.json with sources; PCIe within a host (no NVLink), nothing across hosts."""
    mem = {n: targets.device_memory(n) / 2**20 for n in ("rtx4090", "rtx3090", "l4", "l40s", "a10g")}
    assert mem == {"rtx4090": 24564, "rtx3090": 24576, "l4": 23034, "l40s": 46068, "a10g": 23028}
    peaks = {n: perf_table(n)["peak_flops"]["bf16"] for n in mem}
    assert peaks == {"rtx4090": 165.2e12, "rtx3090": 71e12, "l4": 121e12, "l40s": 362.05e12, "a10g": 70e12}
    for n in mem:
        t = perf_table(n)
        assert t["links"]["fast"]["bus_bytes_per_s"] < 32e9  # PCIe Gen4 x16, not NVLink
        assert t["links"]["slow"]["bus_bytes_per_s"] is None
        for section in ("peak_flops", "gemm", "hbm", "host", "attention"):
            assert len(t[section]["source"]) > 20, (n, section)
        assert "borrowed" in t["gemm"]["source"]  # the GEMM efficiency is H100's, said so
    assert np.isclose(perf_table("rtx4090")["hbm"]["bytes_per_s"], 1008e9)
    assert {"rtx4090", "rtx3090", "l4", "l40s", "a10g"} <= set(targets.target_names("gpu"))
    from fsdp_jax.targets.clusters import format_targets

    listed = {ln.split()[0]: ln for ln in format_targets().splitlines()[1:] if ln and not ln.startswith(" ")}
    for n in mem:  # `plan --list-targets`: PCIe within the box, nothing published across boxes
        assert "25.1 GB/s, 24 us" in listed[n] and "unpublished" in listed[n] and "PCIe" in listed[n], listed[n]


def test_search_plans_the_quantised_base_and_its_winner_keeps_it():
    """`plan --search` (analytic): every candidate holds the NF4 codes (fewer param bytes than
    the bf16 base's), the report names the scheme, and the winner's YAML carries it."""
    import yaml

    from fsdp_jax.app.planner import search as se
    from fsdp_jax.app.planner.search_report import format_search, winner_yaml

    space = se.SearchSpace(
        strategies=("full_shard", "no_shard"), remats=("full",), microbatches=(1,), offloads=("none",)
    )
    limits = se.Limits(device_memory=10**12, max_compiles=0)
    q = ["lora.base_quant=nf4", "lora.double_quant=true"]
    docs = {name: se.search(config(*extra), 8, space, limits) for name, extra in (("nf4", q), ("bf16", []))}
    params = {n: {tuple(c["overrides"]): c["analytic"]["params"] for c in d["candidates"]} for n, d in docs.items()}
    assert params["nf4"].keys() == params["bf16"].keys() and all(
        params["nf4"][k] < params["bf16"][k] for k in params["nf4"]
    )
    assert docs["nf4"]["lora"]["base_quant_label"] == "nf4/64/dq" and "base_quant" not in docs["bf16"]["lora"]
    assert "quantised (nf4/64/dq)" in format_search(docs["nf4"])
    # the winner has its row even when it ranks below the rows shown (a compiled fit on an L4
    # ranked below ten analytic offload plans and was missing from the table)
    w = docs["nf4"]["winner"]
    table = format_search(docs["nf4"], rows=0).splitlines()
    rows = [ln for ln in table if ln.endswith(" ".join(w["overrides"])) and not ln.startswith("winner")]
    assert len(rows) == 1 and rows[0].split()[0] == str(w["rank"]) and " fits " in rows[0], rows
    lora = yaml.safe_load(winner_yaml(docs["nf4"]))["lora"]
    assert (lora["base_quant"], lora["quant_block"], lora["double_quant"]) == ("nf4", 64, True)


QLORA_70B = [  # docs/qlora.md's 70B QLoRA step on 2 x RTX 4090, cut to 2 layers
    "lora.rank=16",
    "lora.alpha=32",
    "lora.base_quant=nf4",
    "lora.double_quant=true",
    "data.seq_len=512",
    "train.global_batch=2",
    "model.attention=cudnn",
    "model.n_layers=2",
]


@pytest.fixture(scope="module")
def rtx4090_70b(gpu_plans):
    """The 2-layer 70B QLoRA full_shard step compiled for 2 x RTX 4090 (`plan --json`)."""
    return gpu_plans[1]["strategies"]["full_shard"]


@pytest.mark.slow
@NOT_FITTED_TO_JAX_0_12
def test_the_frozen_head_is_not_counted_on_top_of_the_layers(rtx4090_70b):
    """XLA:GPU (RTX 4090, compile only): the frozen embedding / head (bf16[32000, 8192], 0.52 GB
    gathered) is gathered outside the layer loop and its buffer reused for the layers' codes
    and dequantised weights, so the analytic transient bytes (grads + gathered + activations)
    stay above the compiled temp by less than that gather. Counting it on top of the layers,
    as before, the model was 0.94 GB over at 4 layers (24.71 GB against 23.44 at 80) and
    `--search` dropped the plan that fits."""
    a, c = rtx4090_70b["analytic"], rtx4090_70b["compiled"]
    head = 32000 * 8192 * 2  # the gathered bf16 embedding or head
    assert c["argument"] == argument_bytes(a)
    over = a["grads"] + a["gathered"] + a["activations"] - c["temp"]
    assert 0 <= over < head, (over, head)
