"""FP8 in the compiled program (docs/fp8.md): under full_shard the per-layer weight
all-gathers move float8_e4m3fn (half the bytes of bf16), on 8 CPU devices (the program
after SPMD partitioning: XLA:CPU's later passes upcast f8 and bf16 collectives to f32)
and on the deviceless 8 x H100 target (the compiled program itself), where the projections'
GEMMs take f8 operands and attention's and the head's do not."""

import collections
import dataclasses
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest
from test_fp8 import built, cfg_for

from fsdp_jax.app.devices import without_compilation_cache
from fsdp_jax.app.models.decoder import FP8_WEIGHTS
from fsdp_jax.hlo.costs import op_inventory
from fsdp_jax.targets import gpu as targets
from helpers import TINY_MODEL_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
FP8 = "params=float32,compute=bfloat16,matmul=fp8"
BF16 = "params=float32,compute=bfloat16"
ITEMSIZE = {"f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f32": 4, "s32": 4}
ARRAY = re.compile(r"([a-z0-9]+)\[([0-9,]*)\]")


def collective_arrays(hlo: str, op: str = "all-gather") -> list[tuple[str, tuple[int, ...]]]:
    """(dtype, dims) of each array the `op` collectives (sync, or async starts) produce: for a
    start, whose result is (operands, results), the results half."""
    out = []
    for line in hlo.splitlines():
        m = re.search(rf"= (.*?) {op}(-start)?\(", line)
        if not m:
            continue
        arrays = ARRAY.findall(m.group(1))
        if m.group(2):
            arrays = arrays[len(arrays) // 2 :]
        out += [(dtype, tuple(int(d) for d in dims.split(",") if d)) for dtype, dims in arrays]
    return out


def expert_arrays(hlo: str, op: str = "all-gather") -> list[tuple[str, tuple[int, ...]]]:
    """`collective_arrays` that are a MoE's expert weights or their grads: 3-D with a dim of
    N_EXPERTS (XLA:GPU may move the gathered dim first: f8e4m3fn[128,6,128])."""
    return [(t, dims) for t, dims in collective_arrays(hlo, op) if len(dims) == 3 and N_EXPERTS in dims]


def gathered(hlo: str, experts: bool = False, op: str = "all-gather") -> collections.Counter:
    """Bytes per dtype that the all-gathers produce (`experts`: of the expert weights only;
    `op`: another collective)."""
    out = collections.Counter()
    for dtype, dims in expert_arrays(hlo, op) if experts else collective_arrays(hlo, op):
        out[dtype] += math.prod(dims) * ITEMSIZE.get(dtype, 4)
    return out


def cpu_partitioned(precision: str, tmp: Path) -> str:
    """The tiny decoder's full_shard step on 8 CPU devices, as the SPMD partitioner left it."""
    cfg = dataclasses.replace(cfg_for("tensorwise", "bfloat16"), precision=precision)
    b = built(cfg, "full_shard", 8)
    batch = jax.ShapeDtypeStruct((8, 17), jnp.int32, sharding=b.plan.batch)
    dump = tmp / precision.replace(",", "_").replace("=", "-")
    opts = {"xla_dump_to": str(dump), "xla_dump_hlo_pass_re": "spmd-partitioning"}
    with without_compilation_cache():  # a cache hit compiles (and dumps) nothing
        b.train_step.lower(b.abstract_state, batch).compile(compiler_options=opts)
    (path,) = [p for p in dump.glob("*jit_step*after_spmd-partitioning*.txt")]
    return path.read_text()


@pytest.mark.slow
def test_full_shard_gathers_f8_weights_on_cpu(tmp_path):
    fp8, bf16 = gathered(cpu_partitioned(FP8, tmp_path)), gathered(cpu_partitioned(BF16, tmp_path))
    # bf16: the projections' and the embedding's gathers; fp8: the projections' moved to f8
    assert fp8["f8e4m3fn"] > 0 and bf16["f8e4m3fn"] == 0
    moved = bf16["bf16"] - fp8["bf16"]  # the projections' bf16 bytes
    assert moved > 0 and fp8["f8e4m3fn"] * 2 == moved, (fp8, bf16)


_CHILD = r"""
import collections, json, re, sys
from fsdp_jax.app.models.decoder import FP8_WEIGHTS
from fsdp_jax.hlo.costs import op_inventory
from fsdp_jax.targets import gpu as targets
from fsdp_jax.app.config import load_config
from fsdp_jax.app.planner.abstract_step import build_step
req = json.loads(sys.stdin.read())
devs = targets.gpu_devices("h100", 1, 8)
out = {}
for name, overrides in req["jobs"].items():
    cfg = load_config(req["config"], req["small"] + overrides)
    out[name] = build_step(cfg, "full_shard", devs).compile().as_text()
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def h100():
    """The tiny FP8 and bf16 full_shard steps compiled for 8 x H100 in one child process."""
    assert targets.plugin_installed(), "run `python -m fsdp_jax.targets install` (README's set-up)"
    small = [*TINY_MODEL_OVERRIDES, "model.d_model=128", "model.ffn_dim=256", "remat=dots"]
    req = {
        "config": "configs/tiny.yaml",
        "small": small,
        "jobs": {
            "fp8": [f"precision={FP8}"],
            "bf16": [f"precision={BF16}"],
            "moe_fp8": [f"precision={FP8}", *MOE],
            "moe_fp8_no_gather": [f"precision={FP8}", *MOE, "fp8.gather=false"],
            "rowwise": [f"precision={FP8}", "fp8.recipe=rowwise"],
            "moe_rowwise": [f"precision={FP8}", *MOE, "fp8.recipe=rowwise"],
        },
    }
    env = targets.child_env(dict(os.environ, PYTHONPATH=str(ROOT)))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], input=json.dumps(req), capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


N_EXPERTS = 6
MOE = [f"model.n_experts={N_EXPERTS}", "model.experts_per_token=2", "model.moe_ffn_dim=128", "model.grouped_matmul=xla"]


def gemm_ops(hlo: str) -> list[tuple[tuple[str, ...], str, tuple[int, ...]]]:
    """Each GEMM fusion's (operand dtypes, its dot's op_name, the dot's result dims). jax 0.12's
    XLA:GPU prefixes the fusions' computations (`%fused_computation.gemm_fusion_dot.62_computation`)."""
    out = []
    for m in re.finditer(r"%(?:[\w.]+\.)?gemm_fusion_dot[^ ]*_computation[^ ]* \(([^)]*)\)[^{]*\{(.*?)\n\}", hlo, re.S):
        dot = next(line for line in m.group(2).splitlines() if " dot(" in line)
        dims = tuple(int(d) for d in ARRAY.search(dot.split("=", 1)[1]).group(2).split(",") if d)
        name = re.search(r'op_name="([^"]*)"', dot)
        out.append((tuple(sorted({d for d, _ in ARRAY.findall(m.group(1))})), name.group(1) if name else "", dims))
    return out


def gemms(hlo: str) -> list[tuple[str, ...]]:
    """The operand dtypes of each GEMM: XLA:GPU's dot fusions (Triton, deviceless) and
    cuBLAS custom calls' dot computations."""
    out = []
    for m in re.finditer(r"%(?:[\w.]+\.)?gemm_fusion_dot[^ ]*_computation[^ ]* \(([^)]*)\)", hlo):
        out.append(tuple(sorted({d for d, _ in ARRAY.findall(m.group(1))})))
    return out


@pytest.mark.slow
def test_h100_full_shard_gathers_f8_and_runs_f8_gemms_for_projections_only(h100):
    fp8, bf16 = gathered(h100["fp8"]), gathered(h100["bf16"])
    assert fp8["f8e4m3fn"] > 0 and bf16["f8e4m3fn"] == 0
    moved = bf16["bf16"] - fp8["bf16"]
    assert moved > 0 and fp8["f8e4m3fn"] * 2 == moved, (fp8, bf16)
    g8, g16 = collections.Counter(gemms(h100["fp8"])), collections.Counter(gemms(h100["bf16"]))
    assert not any(d.startswith("f8") for g in g16 for d in g)
    # the scanned layer body's 7 projections: forward e4m3 x e4m3, input and weight grads e5m2 x e4m3
    n = len(FP8_WEIGHTS)
    assert g8[("f8e4m3fn",)] == n and g8[("f8e4m3fn", "f8e5m2")] == 2 * n, g8
    # and 9 GEMMs without f8: attention's scores and values (2 forward, 4 backward) and the
    # head (1 forward, 2 backward)
    assert sum(v for k, v in g8.items() if not any(d.startswith("f8") for d in k)) == 9, g8


@pytest.mark.slow
def test_h100_moe_expert_gemms_take_f8_and_the_router_none(h100):
    """The tiny MoE (6 experts, XLA's ragged_dot) under matmul=fp8: every GEMM XLA:GPU makes of
    the experts' ragged dots takes f8 operands, e4m3 in the forward and e5m2 x e4m3 in the
    backward; the router's (the only GEMMs with a dim of 6 outside them) take none."""
    ops = gemm_ops(h100["moe_fp8"])
    experts = [(d, n) for d, n, _ in ops if "ragged_dot" in n]
    assert experts and all(any(t.startswith("f8") for t in d) for d, _ in experts), experts
    assert any(d == ("f8e4m3fn",) for d, n in experts if "transpose" not in n)
    assert any(d == ("f8e4m3fn", "f8e5m2") for d, n in experts if "transpose" in n)
    router = [d for d, n, dims in ops if "ragged_dot" not in n and 6 in dims]
    assert len(router) >= 2 and not any(t.startswith("f8") for d in router for t in d), router
    # the step-time model's records of those GEMMs carry the f8 dtype it prices at the FP8 peak
    recs = [o for o in op_inventory(h100["moe_fp8"]) if o["kind"] == "gemm" and "ragged_dot" in (o["op_name"] or "")]
    assert len(recs) == len(experts) and all(o["dtype"] in ("f8e4m3fn", "f8e5m2") for o in recs), recs


@pytest.mark.slow
def test_h100_rowwise_runs_e4m3_gemms_and_gathers_bf16(h100):
    """The rowwise recipe on 8 x H100: every GEMM but the 9 of attention and the head (as in
    the tensorwise run) takes e4m3 x e4m3, none e5m2; and though the code casts the weight after
    the gather, XLA:GPU moves the cast before it: the gathers move as many f8 bytes as the
    tensorwise run's (and no more bf16).
    (Measured: 18 f8 GEMM fusions for the projections' 21 products; which XLA combined was
    not examined.)"""
    g = collections.Counter(gemms(h100["rowwise"]))
    assert g[("f8e4m3fn",)] > 0 and not any("f8e5m2" in k for k in g), g
    assert sum(v for k, v in g.items() if not any(d.startswith("f8") for d in k)) == 9, g
    rw, tw = gathered(h100["rowwise"]), gathered(h100["fp8"])
    assert rw["f8e4m3fn"] == tw["f8e4m3fn"] > 0 and rw["bf16"] == tw["bf16"], (rw, tw)


@pytest.mark.slow
def test_h100_moe_expert_weights_gather_f8_and_scatter_wide_grads(h100):
    """The tiny MoE under fp8.gather (the default) on 8 x H100, full_shard: every all-gather of
    an expert weight moves e4m3, the same arrays that fp8.gather=false gathers in bf16, so half
    the bytes per gather, and no bf16 / f32 expert weight is gathered; the expert gradients'
    reduce-scatters are in the reduce dtype (f32), not f8. (The f8 program holds more gathers and
    scatters: XLA:GPU pipelines its backward loop's collectives, one iteration's out of the loop.)"""
    on, off = expert_arrays(h100["moe_fp8"]), expert_arrays(h100["moe_fp8_no_gather"])
    assert on and {t for t, _ in on} == {"f8e4m3fn"}, on
    assert {t for t, _ in off} == {"bf16"}, off
    assert {d for _, d in on} == {d for _, d in off}  # the same weights, whole; 1 byte an element against 2
    scatters = expert_arrays(h100["moe_fp8"], "reduce-scatter")
    assert scatters and {t for t, _ in scatters} == {"f32"}, scatters
    # the f8 program text holds twice the backward expert GEMMs: XLA:GPU peels one iteration
    # of the backward layer loop into the entry computation (runs 1; the loop's trip count one
    # less): per step both programs run the same expert GEMMs, the same FLOPs
    runs = {k: expert_gemm_runs(h100[k]) for k in ("moe_fp8", "moe_fp8_no_gather")}
    assert runs["moe_fp8"]["flops"] == runs["moe_fp8_no_gather"]["flops"] and runs["moe_fp8"]["flops"]["bwd"] > 0, runs
    assert runs["moe_fp8"]["peeled"] > 0 == runs["moe_fp8_no_gather"]["peeled"], runs


def expert_gemm_runs(hlo: str) -> dict:
    """The expert GEMMs of a program per step (`op_inventory`: a record's FLOPs x its runs, the
    loops' trip counts multiplied in): `flops`, by direction; `peeled`: how many backward ones
    sit in the entry computation (run once, outside the layer loops)."""
    recs = [o for o in op_inventory(hlo) if o["kind"] == "gemm" and "ragged_dot" in (o["op_name"] or "")]
    entry = re.search(r"^ENTRY %?([\w.\-]+)", hlo, re.M).group(1)
    flops = collections.Counter()
    for o in recs:
        flops["bwd" if "transpose" in o["op_name"] else "fwd"] += o["flops"] * o["runs"]
    peeled = sum(o["computation"] == entry and "transpose" in o["op_name"] for o in recs)
    return {"flops": dict(flops), "peeled": peeled}


@pytest.mark.slow
def test_h100_rowwise_moe_gathers_f8_expert_weights_with_their_scales(h100):
    """Rowwise experts under fp8.gather (the default) on 8 x H100, full_shard: every all-gather
    of a whole expert weight moves e4m3 (the arrays fp8.gather=false gathers in bf16), none bf16;
    beside them the scales of the dim a cast spans and the gather does not, f32 (XLA:GPU drops
    their size-1 dim: f32[128,6], none in the compute-dtype run); the expert gradients
    reduce-scatter in f32; the expert GEMMs take e4m3 only."""
    weights, off = expert_arrays(h100["moe_rowwise"]), expert_arrays(h100["moe_fp8_no_gather"])
    assert weights and {t for t, _ in weights} == {"f8e4m3fn"}, weights
    assert {d for _, d in weights} == {d for _, d in off}  # the same weights, whole

    def scales(hlo):
        return [d for t, d in collective_arrays(hlo) if t == "f32" and len(d) == 2 and N_EXPERTS in d]

    assert scales(h100["moe_rowwise"]) and not scales(h100["moe_fp8_no_gather"])
    scatters = expert_arrays(h100["moe_rowwise"], "reduce-scatter")
    assert scatters and {t for t, _ in scatters} == {"f32"}, scatters
    experts = [d for d, n, _ in gemm_ops(h100["moe_rowwise"]) if "ragged_dot" in n]
    assert experts and all(d == ("f8e4m3fn",) for d in experts), experts
