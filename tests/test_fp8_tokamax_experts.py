"""FP8 with a dropless MoE whose grouped products tokamax's kernels run (docs/fp8.md "Routed
experts"): the experts stay in the compute dtype, and `plan` and `train` say so; the step-time
roofline and the search's traffic cost those products at the bf16 peak and their weights'
gathers in the compute dtype. Under `model.grouped_matmul: xla` or capacity mode the experts
are FP8 and nothing is said."""

import json

import pytest

from fsdp_jax.app.config import load_config
from fsdp_jax.app.config.fp8_checks import unscaled_experts
from fsdp_jax.app.models import grouped_matmul
from fsdp_jax.app.planner import gathered_memory
from fsdp_jax.app.planner.abstract_step import build_step
from fsdp_jax.app.planner.estimate import fp8_part
from fsdp_jax.app.planner.search_prediction import analytic_communication
from fsdp_jax.app.planner.step_time import model_flops_per_token, predict_roofline, step_tokens
from fsdp_jax.app.trainer import setup as trainer_setup
from fsdp_jax.sharding.precision import Policy
from fsdp_jax.targets import gpu as targets
from fsdp_jax.targets.perf_tables import perf_table
from helpers import ROOT, TINY_MODEL_OVERRIDES, call

FP8 = "precision=params=float32,compute=bfloat16,matmul=fp8"
E, K, F = 6, 2, 128
MOE = [f"model.n_experts={E}", f"model.experts_per_token={K}", f"model.moe_ffn_dim={F}", "remat=none"]
KERNELS = {"tokamax": [], "xla": ["model.grouped_matmul=xla"], "capacity": ["model.capacity_factor=2.0"]}
SAID = "run in bfloat16 under tokamax's kernels"


def cfg_for(kernels: str, *extra: str):
    return load_config(ROOT / "configs" / "tiny.yaml", [*TINY_MODEL_OVERRIDES, FP8, *MOE, *KERNELS[kernels], *extra])


def expert_params(cfg, active: bool) -> int:
    """The routed experts' matrices, by hand from the shapes: every layer sparse, 3 per expert."""
    m = cfg.model
    return m.n_layers * 3 * (m.experts_per_token if active else m.n_experts) * m.d_model * m.moe_ffn_dim


@pytest.mark.parametrize("kernels", list(KERNELS))
def test_plan_fp8_part_names_the_experts_dtype_on_h100(kernels):
    h100 = targets.make_target("h100", 8)
    part = fp8_part(cfg_for(kernels), h100)
    want = {"kernels": kernels, "fp8": kernels != "tokamax", "dtype": "bfloat16" if kernels == "tokamax" else "fp8"}
    assert part == {"recipe": "tensorwise", "experts": want}
    # without a target the plan compiles on this CPU, where auto is XLA's ragged_dot: FP8 experts
    assert fp8_part(cfg_for(kernels), None)["experts"]["fp8"]
    assert fp8_part(cfg_for(kernels, "precision=params=float32,compute=bfloat16"), h100) is None


def test_f32_experts_on_a_mosaic_only_gpu_tokamax_are_said_to_run_on_xla(monkeypatch):
    """compute=float32 on a GPU whose tokamax has only its Mosaic GPU kernel (bf16 / f16 operands,
    `grouped_matmul.gpu_misfit`): `auto` runs the unscaled experts on XLA's ragged_dot, and the
    plan's FP8 part and note say that, not tokamax; with a Triton kernel there, tokamax."""
    from fsdp_jax.app.config.fp8_checks import unscaled_experts_line, unscaled_kernels

    h100 = targets.make_target("h100", 8)
    cfg = cfg_for("tokamax", "precision=params=float32,compute=float32,matmul=fp8")
    for impls, kernels in ((("mosaic",), "xla"), (("mosaic", "triton"), "tokamax")):
        monkeypatch.setattr(grouped_matmul, "_tokamax_implementations", lambda impls=impls: impls)
        part = fp8_part(cfg, h100)
        assert part["experts"] == {"kernels": kernels, "fp8": False, "dtype": "float32"}, impls
        assert unscaled_kernels("bfloat16", "gpu") == "tokamax" and unscaled_kernels("float32", "tpu") == "tokamax"
        line = unscaled_experts_line(cfg, "float32", kernels)
        said = "run in float32 on XLA's ragged_dot" if kernels == "xla" else "run in float32 under tokamax's kernels"
        assert said in line, line
    monkeypatch.setattr(grouped_matmul, "_tokamax_implementations", lambda: ("mosaic",))
    assert "takes bfloat16 or float16 operands, not float32" in unscaled_experts_line(cfg, "float32", "xla")


def test_roofline_costs_tokamax_experts_at_the_bf16_peak():
    """Same model, same FLOPs: under tokamax the experts' 6 x (active expert params) FLOPs per
    token move from the FP8 peak to the bf16 one; the full_shard gathers move the experts'
    params in bf16 (2 bytes, not 1)."""
    tok, xla = cfg_for("tokamax"), cfg_for("xla")
    a = {"grads": 0, "params": 0, "optimizer": 0}
    comm = {"total_wire_bytes": 0}
    got = {
        n: predict_roofline(c, "h100", 8, {"analytic": a, "communication": comm})
        for n, c in (("tok", tok), ("xla", xla))
    }
    t = perf_table("h100")
    peak, peak8, eff = t["peak_flops"]["bf16"], t["peak_flops"]["f8e4m3fn"], t["gemm"]["max_efficiency"]
    assert peak8 > peak
    tokens, experts = step_tokens(tok, 8), 6 * expert_params(tok, active=True)
    assert got["tok"]["compute_s"] - got["xla"]["compute_s"] == pytest.approx(
        tokens * experts * (1 / peak - 1 / peak8) / eff, rel=2e-3
    )
    # and the tokamax run's whole compute by hand: the layers' other params at the FP8 peak
    per_token = model_flops_per_token(tok.model, tok.data.seq_len)[0]
    m = tok.model
    d = m.d_model
    attention = 2 * d * d + 2 * d * (d * m.n_kv_heads // m.n_heads)  # wq wo; wk wv n_kv_heads heads wide
    f8 = 6 * m.n_layers * (attention + 2 * d + d * E)  # + the 2 norms and the router, counted with them
    assert got["tok"]["compute_s"] == pytest.approx(tokens * ((per_token - f8) / peak + f8 / peak8) / eff, rel=2e-3)
    wire = {
        n: analytic_communication(c, "full_shard", (1, 8, 1), 1, "h100")["total_wire_bytes"]
        for n, c in (("tok", tok), ("xla", xla))
    }
    assert wire["tok"] - wire["xla"] == pytest.approx(2 * expert_params(tok, active=False) * (2 - 1) * 7 / 8, abs=2)


def test_train_says_so_at_start(monkeypatch, capsys):
    """The trainer's model stage prints the line where the experts resolve to tokamax (here: the
    lowering platform made a GPU's; tokamax is installed) and not under xla / capacity mode."""
    pytest.importorskip("tokamax")
    monkeypatch.setattr(grouped_matmul, "lowering_platform", lambda: "gpu")
    for kernels in KERNELS:
        cfg = cfg_for(kernels)
        capsys.readouterr()
        trainer_setup._model(trainer_setup._Draft(cfg, None, False, True))
        out = capsys.readouterr().out
        assert (SAID in out) == (kernels == "tokamax"), (kernels, out)
        assert (unscaled_experts(cfg) == "bfloat16") == (kernels == "tokamax")


@pytest.mark.slow
def test_plan_on_h100_says_the_experts_run_in_bf16(capsys):
    """End to end, the deviceless 8 x H100 compile of the tiny FP8 MoE under auto (tokamax's
    kernels): --json carries the fp8 part and the note, the text table prints the note."""
    assert targets.plugin_installed(), "run `python -m fsdp_jax.targets install` (README's set-up)"
    pytest.importorskip("tokamax")
    args = ["--config", ROOT / "configs" / "tiny.yaml", "--target", "h100", "--devices", "8"]
    args += ["--strategies", "full_shard", *TINY_MODEL_OVERRIDES, FP8, *MOE]
    rc, out, err = call("plan.py", *args, "--json", capsys=capsys)
    assert rc == 0, err[-2000:]
    doc = json.loads(out)
    assert doc["fp8"]["experts"] == {"kernels": "tokamax", "fp8": False, "dtype": "bfloat16"}
    assert sum(SAID in n for n in doc["notes"]) == 1, doc["notes"]
    assert doc["strategies"]["full_shard"]["predicted"]


@pytest.mark.slow
def test_h100_tokamax_expert_kernels_take_the_compute_dtype():
    """What the note states, in the deviceless 8 x H100 program of the tiny FP8 MoE under auto:
    the experts' grouped products are tokamax's Pallas calls (Triton at this size with tokamax
    0.0.12, Mosaic GPU with 0.0.17), each taking
    bf16 operands, and no GEMM of XLA's ragged_dot is left; the projections' GEMMs take f8."""
    import os
    import re
    import subprocess
    import sys

    from test_fp8_hlo import _CHILD, gemm_ops

    assert targets.plugin_installed(), "run `python -m fsdp_jax.targets install` (README's set-up)"
    pytest.importorskip("tokamax")
    jobs = {"auto": [FP8, *MOE]}
    req = {"config": "configs/tiny.yaml", "small": [*TINY_MODEL_OVERRIDES, "remat=dots"], "jobs": jobs}
    env = targets.child_env(dict(os.environ, PYTHONPATH=str(ROOT)))
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD], input=json.dumps(req), capture_output=True, text=True, env=env, cwd=ROOT
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    hlo = json.loads(proc.stdout)["auto"]
    # tokamax's kernels: named in their op_name (jax 0.10, tokamax 0.0.12), or Mosaic GPU calls
    # (jax 0.12, tokamax 0.0.17: `custom_call_target="mosaic_gpu_v2"`, op_name ".../ragged_dot_sm90/...")
    kernel = re.compile(r'/tokamax:|custom_call_target="mosaic_gpu')
    calls = [line for line in hlo.splitlines() if "custom-call(" in line and kernel.search(line)]
    # forward gate, up, down and their input and weight gradients: at least 9 per layer body
    assert len(calls) >= 9, len(calls)
    for line in calls:
        operands = line.split("operand_layout_constraints={", 1)[1].split("}}", 1)[0]  # each `type[dims]{layout}`
        assert {t for t in re.findall(r"([a-z0-9]+)\[", operands) if t not in ("s32",)} == {"bf16"}, operands
    ops = gemm_ops(hlo)
    assert not [n for _, n, _ in ops if "ragged_dot" in n]
    assert any(t.startswith("f8") for d, _, _ in ops for t in d)


def test_search_says_so_as_it_costs():
    """`plan --search` on h100 (the analytic pass, no compile) notes the tokamax experts under
    auto, as it costs them, and not under xla."""
    from fsdp_jax.app.planner import search as se

    space = se.SearchSpace(strategies=("full_shard",), remats=("none",), microbatches=(1,), offloads=("none",))
    limits = se.Limits(device_memory=10**12, max_compiles=0)
    h100 = targets.make_target("h100", 8)
    for kernels in ("tokamax", "xla"):
        doc = se.search(cfg_for(kernels), 8, space, limits, target=h100)
        assert sum(SAID in n for n in doc["notes"]) == (kernels == "tokamax"), doc["notes"]


def test_the_memory_model_gathers_tokamax_experts_in_the_compute_dtype():
    """full_shard's gathered layer under `fp8.gather`, planned for a GPU: with tokamax's kernels
    the experts' weights are gathered in bf16 (2 bytes), with XLA's ragged_dot in f8 (1 byte):
    one layer's gathered bytes differ by one layer's expert matrices (8 devices, experts not
    split: every device gathers them whole); the rest of the layer is f8 in both."""
    got = {}
    for kernels in ("tokamax", "xla"):
        c = cfg_for(kernels)
        b = build_step(c, "full_shard")
        got[kernels] = gathered_memory._f8_layer(b, Policy.parse(c.precision), "gpu")
    m = cfg_for("xla").model
    assert got["tokamax"] - got["xla"] == 3 * m.n_experts * m.d_model * m.moe_ffn_dim * (2 - 1), got
