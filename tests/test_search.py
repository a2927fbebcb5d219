"""plan.py --search (fsdp_jax.app.planner.search): pruning against compiled programs, the ranked
document, and bad input."""

import dataclasses
import json
import re
from pathlib import Path

import pytest
import yaml

from fsdp_jax.app.config import load_config
from fsdp_jax.app.planner import search as se
from fsdp_jax.app.planner.abstract_step import mesh_shape
from fsdp_jax.app.planner.report import COMPILED_OVER_ANALYTIC
from fsdp_jax.app.planner.search_prediction import analytic_communication, predict_step, recompute_flops_per_token
from fsdp_jax.app.planner.search_space import ANALYTIC_OVER, candidate_config
from fsdp_jax.sharding.remat import device_policies
from fsdp_jax.targets.plugins import INSTALL_HINT
from helpers import TINY_MODEL_OVERRIDES, call, one_line

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
# configs/tiny.yaml shrunk to compile in seconds; bf16 compute as on a GPU
SMALL = [*TINY_MODEL_OVERRIDES, "train.steps=10", "precision=params=float32,compute=bfloat16"]
GRID = se.SearchSpace(
    strategies=("no_shard", "shard_grad_op", "full_shard"),
    remats=("none", "full"),
    microbatches=(1, 2),
    offloads=("none",),
)


def _cands(cfg, limits, space=GRID):
    from fsdp_jax.verify.run import devices_for

    cands, _ = se.enumerate_candidates(cfg, 8, space, lambda s: mesh_shape(cfg, s, 8))
    se.analytic_pass(cfg, 8, cands, limits, 1, 8, "h100", devices_for(8), platform="gpu")  # as search() for h100
    return cands


@pytest.fixture(scope="module")
def cfg():
    return load_config(TINY_YAML, SMALL)


@pytest.fixture(scope="module")
def compiled_grid(cfg):
    """Every candidate of GRID compiled for 8 x H100 (one child process, one kernel cache)."""
    from fsdp_jax.targets import gpu as targets

    assert targets.plugin_installed(), f"run `{INSTALL_HINT}` (the CUDA compile-only plugin)"
    target = targets.make_target("h100", devices=8)
    cands = _cands(cfg, se.Limits(device_memory=10**12))
    from fsdp_jax.app.planner.search_compile import compile_candidates

    results = compile_candidates(cfg, 8, cands, target, progress=lambda m: None)
    return cands, [r["compiled"]["device_peak"] for r in results], target


@pytest.mark.slow
def test_pruning_never_drops_a_candidate_whose_compiled_program_fits(cfg, compiled_grid):
    """For a budget at every candidate's compiled peak (the tightest edges there are), the
    analytic pass keeps every candidate whose compiled device peak fits, and it does prune."""
    cands, peaks, _ = compiled_grid
    assert len(cands) == 12 and len(set(peaks)) > 4
    pruned_somewhere = False
    for budget in sorted(set(peaks)):
        fresh = _cands(cfg, se.Limits(device_memory=budget, headroom_fraction=None))
        for c, peak in zip(fresh, peaks):
            if peak <= budget:
                assert c["status"] != "dropped", (budget, se.overrides(cfg, c), peak, c["analytic"]["device_total"])
            pruned_somewhere |= c["status"] == "dropped"
    assert pruned_somewhere


@pytest.mark.slow
def test_analytic_memory_ranks_candidates_as_the_gpu_compile_does(cfg, compiled_grid):
    """Within the model's stated error of each compiled peak, and in the same order wherever
    two candidates' analytic totals differ by more than that error."""
    cands, peaks, _ = compiled_grid
    ana = [c["analytic"]["device_total"] for c in cands]
    for a, p, c in zip(ana, peaks, cands):
        assert -ANALYTIC_OVER <= p / a - 1 <= COMPILED_OVER_ANALYTIC, (se.overrides(cfg, c), p, a)
    for i in range(len(cands)):
        for j in range(len(cands)):
            if ana[i] * (1 - ANALYTIC_OVER) > ana[j] * (1 + COMPILED_OVER_ANALYTIC):
                assert peaks[i] > peaks[j], (se.overrides(cfg, cands[i]), se.overrides(cfg, cands[j]))


@pytest.mark.slow
def test_search_winner_compiles_within_the_budget(cfg, compiled_grid):
    """The search on the GPU target with a budget between the grid's peaks: its winner is
    compiled, fits the device memory minus the headroom, and is the best-ranked survivor."""
    _, peaks, target = compiled_grid
    mem = int(sorted(peaks)[len(peaks) // 2] / 0.9)  # 10% headroom: the median peak just fits
    doc = se.search(cfg, 8, GRID, se.Limits(device_memory=mem), target=target)
    w = doc["winner"]
    assert w is not None and w["compiled"] is not None and w["compiled"]["platform"] == "gpu"
    assert w["compiled"]["device_peak"] <= doc["budget"] == mem - doc["headroom"]
    assert w["predicted"]["source"] == "compiled" and w["rank"] == min(
        c["rank"] for c in doc["candidates"] if se.verified(c)
    )
    assert 1 <= doc["counts"]["compiled"] <= 4  # only a few were compiled
    above = [c for c in doc["candidates"] if c["rank"] < w["rank"]]
    if doc["counts"]["compiled"] < 4:  # compiles left: nothing above the winner could still fit
        assert all(c["status"] == "dropped" for c in above)
    assert any(c["status"] == "dropped" for c in doc["candidates"])


@pytest.mark.slow
def test_json_document_schema_and_yaml_winner(capsys):
    rc, out, err = call(
        "plan.py",
        "--config",
        TINY_YAML,
        "--devices",
        "8",
        "--device-memory",
        "1.2MB",
        "--search",
        "--max-compiles",
        "0",
        "--vary",
        "batch,seq",
        "--json",
        *SMALL,
        capsys=capsys,
    )
    assert rc == 0, err
    doc = json.loads(out)
    assert {
        "config",
        "devices",
        "target",
        "device_memory",
        "headroom",
        "budget",
        "ranked_by",
        "space",
        "counts",
        "candidates",
        "dropped",
        "winner",
        "smallest_fitting_memory",
        "notes",
        "wall_s",
        "yaml",
    } <= set(doc)
    assert doc["budget"] == doc["device_memory"] - doc["headroom"] == 1_080_000
    assert doc["ranked_by"].startswith("analytic cost")  # no GPU target: said so
    cands = doc["candidates"]
    assert len(cands) == doc["counts"]["candidates"] > 100
    assert {(c["global_batch"], c["seq_len"]) for c in cands} >= {(16, 32), (8, 32), (32, 16)}
    speeds = [c["predicted"]["tokens_per_s_per_gpu"] for c in cands]
    assert speeds == sorted(speeds, reverse=True) and [c["rank"] for c in cands] == list(range(1, len(cands) + 1))
    for c in cands:
        assert c["status"] in ("fits", "edge", "dropped") and isinstance(c["reason"], str)
        assert {"params", "grads", "optimizer", "activations", "device_total", "host"} <= set(c["analytic"])
        assert {"step_s", "tokens_per_s_per_gpu", "mfu", "host_s", "source"} <= set(c["predicted"])
        assert c["compiled"] is None
        assert c["device_peak"] == c["analytic"]["device_total"] == doc["device_memory"] - c["free"]
        assert (c["status"] == "fits") == (c["analytic"]["device_total"] <= doc["budget"])
    w = doc["winner"]
    assert w == next(c for c in cands if c["status"] == "fits")
    snippet = yaml.safe_load(doc["yaml"])
    assert snippet["mesh"]["strategy"] == w["strategy"] and snippet["remat"] == w["remat"]
    assert snippet["train"]["microbatches"] == w["microbatches"] and snippet["offload"] == w["offload"]
    assert {c["status"] for c in cands} == {"fits", "edge", "dropped"}
    assert sum(doc["dropped"].values()) == len(cands) - doc["counts"]["fits"]


def test_table_and_progress(capsys):
    rc, out, err = call(
        "plan.py",
        "--config",
        TINY_YAML,
        "--devices",
        "8",
        "--device-memory",
        "40MB",
        "--search",
        "--max-compiles",
        "0",
        "--rows",
        "3",
        "--offload",
        "none",
        "--progress",
        *SMALL,
        capsys=capsys,
    )
    assert rc == 0, err
    assert "search: " in err and "candidates; analytic pass" in err
    rows = [l for l in out.splitlines() if re.match(r"\s+\d+ ", l)]
    assert len(rows) == 3 and "mesh.strategy=" in rows[0]
    assert "winner: mesh.strategy=" in out and "\nmesh:\n  strategy: " in out


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--remat", ""], "--remat"),
        (["--remat", "sometimes"], "--remat"),
        (["--microbatches", "0"], "--microbatches"),
        (["--microbatches", "two"], "--microbatches"),
        (["--microbatches", ","], "--microbatches"),
        (["--microbatches", "3"], "search space is empty"),  # divides no per-device batch (2)
        (["--offload", "everything"], "--offload"),
        (["--offload", ","], "--offload"),
        (["--strategies", ","], "--strategies"),
        (["--vary", "width"], "--vary"),
        (["--attention", "flash"], "--attention"),
        (["--attention", ","], "--attention"),
        (["--headroom", "100%"], "--headroom"),  # impossible constraints
        (["--headroom", "2GB"], "--headroom"),
        (["--headroom", "-5%"], "--headroom"),
        (["--offload", "optimizer", "--host-memory", "1KB"], "--host-memory"),
        (["--host-memory", "lots"], "--host-memory"),
        (["--max-compiles", "-1"], "--max-compiles"),
        (["--rows", "x"], "--rows"),
        (["--plot", "p.png"], "--plot"),
    ],
)
def test_bad_search_input_exits_2_with_one_line(args, needle, capsys):
    rc, out, err = call(
        "plan.py",
        "--config",
        TINY_YAML,
        "--devices",
        "8",
        "--device-memory",
        "1GB",
        "--search",
        "--max-compiles",
        "0",
        *args,
        *SMALL,
        capsys=capsys,
    )
    one_line(rc, err, needle)  # no progress lines: stderr is not a terminal
    assert out == ""


@pytest.mark.parametrize(
    "flag,value", [("--remat", "full"), ("--vary", "batch"), ("--attention", "cudnn"), ("--headroom", "5%")]
)
def test_search_flags_need_search(flag, value, capsys):
    rc, _, err = call("plan.py", "--config", TINY_YAML, "--devices", "8", flag, value, capsys=capsys)
    one_line(rc, err, flag, "--search")


def test_cpu_search_needs_a_device_memory(capsys):
    rc, _, err = call("plan.py", "--config", TINY_YAML, "--devices", "8", "--search", capsys=capsys)
    one_line(rc, err, "--device-memory")


def test_nothing_fits_names_the_smallest_memory_that_does(capsys):
    base = ["--config", TINY_YAML, "--devices", "8", "--search", "--max-compiles", "0", "--offload", "none", *SMALL]
    rc, _, err = call("plan.py", *base, "--device-memory", "100KB", capsys=capsys)
    line = one_line(rc, err, "none of", "fits", "smallest device memory")
    need = re.search(r"would fit is ([\d.]+GB)", line).group(1)
    rc, out, err = call("plan.py", *base, "--device-memory", need, "--json", capsys=capsys)
    assert rc == 0, err
    assert json.loads(out)["winner"] is not None
    smaller = f"{float(need[:-2]) - 0.01:.2f}GB"
    rc, _, err = call("plan.py", *base, "--device-memory", smaller, capsys=capsys)
    assert rc == 2  # the named size is the least that fits, to the 0.01 GB it is printed in


def test_nothing_fits_names_the_largest_batch_that_would(capsys):
    """Issue 56 item 4: when no configuration fits at the config's batch, the line says which
    smaller global batch would (the same search varying the batch, analytic only), and that
    batch does fit when asked for."""
    base = ["--config", TINY_YAML, "--devices", "8", "--search", "--max-compiles", "0", "--offload", "none", *SMALL]
    rc, out, err = call("plan.py", *base, "--device-memory", "100KB", "--json", capsys=capsys)
    one_line(rc, err, "none of")
    smaller = str(int(json.loads(out)["smallest_fitting_memory"] * 0.98))  # bytes: the config's batch no longer fits
    rc, _, err = call("plan.py", *base, "--device-memory", smaller, capsys=capsys)
    line = one_line(rc, err, "none of", "at a smaller batch", "--vary batch")
    gb = int(re.search(r"train.global_batch=(\d+) fits", line).group(1))
    assert gb < cfg_global_batch(TINY_YAML, SMALL)
    rc, out, err = call(
        "plan.py", *base, f"train.global_batch={gb}", "--device-memory", smaller, "--json", capsys=capsys
    )
    assert rc == 0, err
    assert json.loads(out)["winner"] is not None


def cfg_global_batch(path, overrides) -> int:
    """The config's global batch after `overrides` (as `plan` loads it)."""
    return load_config(path, list(overrides)).train.global_batch


def test_analytic_communication_matches_the_textbook(cfg):
    """ZeRO-3 3P(N-1)/N, ZeRO-2 2P(N-1)/N, DDP 2P(N-1)/N per device per step with P the params
    in the compute dtype (BENCHMARKS.md: the GPU compile's bytes at 7B and 70B), x microbatches
    for the sharded strategies; HSDP's cross-host all-reduce of the fsdp shards."""
    import dataclasses

    from fsdp_jax.app.models.decoder import count_params

    p, f = 2 * count_params(cfg.model), 7 / 8  # bf16 compute
    wire = lambda c, s, sizes=(1, 8, 1), hosts=1: analytic_communication(c, s, sizes, hosts)  # noqa: E731
    assert wire(cfg, "no_shard")["total_wire_bytes"] == int(2 * p * f)
    assert wire(cfg, "shard_grad_op")["total_wire_bytes"] == int(2 * p * f)
    assert wire(cfg, "full_shard")["total_wire_bytes"] == int(3 * p * f)
    two = dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, microbatches=2))
    assert wire(two, "full_shard")["total_wire_bytes"] == int(2 * 3 * p * f)
    hsdp = wire(cfg, "hybrid_shard", (2, 4, 1), 2)
    assert hsdp["analytic"]["cross_host_wire_bytes"] == int(2 * p / 4 * 0.5)
    assert hsdp["total_wire_bytes"] == int(3 * p * 3 / 4 + 2 * p / 4 * 0.5)
    assert wire(cfg, "full_shard", (1, 8, 1), 2)["analytic"]["cross_host_wire_bytes"] == int(3 * p * f)


def test_pruning_keeps_edge_candidates_within_the_model_error(cfg):
    """Analytic over budget by less than ANALYTIC_OVER: kept as edge (to compile), not dropped;
    beyond: dropped; offload candidates (never compiled here) are held to the analytic total."""
    space = dataclasses.replace(GRID, offloads=("none", "optimizer"))
    base = _cands(cfg, se.Limits(device_memory=10**12), space)
    mid = sorted(c["analytic"]["device_total"] for c in base)[len(base) // 2]
    again = _cands(cfg, se.Limits(device_memory=mid, headroom_fraction=None), space)
    seen = set()
    for c in again:
        dev = c["analytic"]["device_total"]
        a = c["analytic"]
        exact = a["params"] + a["optimizer"] + a["batch"]
        lower = exact + (a["total"] - exact) * (1 - ANALYTIC_OVER)
        want = "fits" if dev <= mid else "edge" if c["offload"] == "none" and lower <= mid else "dropped"
        assert c["status"] == want, (se.overrides(cfg, c), dev, mid)
        seen.add(want)
    assert seen == {"fits", "edge", "dropped"}


def test_recompute_per_remat_policy_by_hand(cfg):
    """d 64, ffn 128, q 4 x 16, kv 2 x 16, seq 32, 2 layers: qkv 2*64*(64+64) = 16384, attention
    core 4*32*64 = 8192, gate+up 4*64*128 = 32768 FLOPs per token per layer."""
    m, s = cfg.model, cfg.data.seq_len
    got = {r: recompute_flops_per_token(m, s, r) for r in device_policies() + ("offload_attn_mlp_out",)}
    assert got == {
        "none": 0,
        "dots": 0,
        "full": 0,  # full: step_time.predict counts it already
        "dots_no_batch": 2 * 8192,
        "save_qkv_attn_mlp_out": 2 * (8192 + 32768),
        "save_attn_mlp_out": 2 * (16384 + 8192 + 32768),
        "offload_attn_mlp_out": 2 * (16384 + 8192 + 32768),
    }
    import dataclasses

    from fsdp_jax.app.planner import step_time

    res = {"analytic": {"grads": 0, "params": 0, "optimizer": 0}, "communication": {"total_wire_bytes": 0}}
    with_remat = lambda r: dataclasses.replace(cfg, remat=r)  # noqa: E731
    dots, saved = (predict_step(with_remat(r), "h100", 8, res) for r in ("dots", "save_attn_mlp_out"))
    tokens = s * cfg.train.global_batch / 8
    k = step_time.roofline_constants("h100")  # the op-by-op model's table: 989 TFLOP/s x 0.582
    extra = tokens * got["save_attn_mlp_out"] / (k["peak"] * k["efficiency"])
    assert saved["step_s"] - dots["step_s"] == pytest.approx(extra, rel=2e-3)
    res["analytic"]["transfer_per_step"] = 5 * 10**9
    host = predict_step(with_remat("dots"), "h100", 8, res)
    assert host["host_s"] == pytest.approx(0.1)  # 5 GB at 50 GB/s, not hidden
    assert host["step_s"] == pytest.approx(dots["step_s"] + 0.1, rel=1e-3)
    # the band is +-15% around the step it reports, the transfers included (issue 56 item 4)
    assert host["band_s"] == pytest.approx([host["step_s"] * 0.85, host["step_s"] * 1.15], rel=1e-3)
    # each target's own host link (perf_tables.json): A100 PCIe Gen4, a TPU chip's (scaling-book: v5p 15, v6e 32)
    for target, gb_per_s in (("a100", 25), ("v5p", 15), ("v6e", 32)):
        other = predict_step(with_remat("dots"), target, 8, res)
        assert other["host_s"] == pytest.approx(5 / gb_per_s, rel=1e-3), target  # 4 significant figures


def test_tpu_target_search_ranks_by_the_tpu_chip_prediction(cfg):
    """--search on a TPU target ranks by step_time's prediction with that chip's figures,
    not H100's: hand-derived compute time at v5p's 459 TFLOP/s (x the TPU table's GEMM
    efficiency), ICI at 600 GB/s per direction (x its link efficiency); the ranking is by
    those tokens/s per chip. No compile (the analytic pass alone), so no libtpu needed."""
    from fsdp_jax.app.planner.search_report import format_search
    from fsdp_jax.app.planner.step_time import model_flops_per_token
    from fsdp_jax.targets import gpu as targets
    from fsdp_jax.targets.perf_tables import perf_table

    t = perf_table("v5p")
    eff, ici = t["gemm"]["max_efficiency"], t["links"]["fast"]["efficiency"]

    target = targets.make_target("v5p", devices=8)
    doc = se.search(cfg, 8, GRID, se.Limits(device_memory=10**12, max_compiles=0), target=target)
    assert doc["ranked_by"] == "predicted tokens/s per chip"
    assert not any("H100" in n for n in doc["notes"])
    tokens = cfg.data.seq_len * cfg.train.global_batch / 8
    per_token, attn = model_flops_per_token(cfg.model, cfg.data.seq_len)
    for c in doc["candidates"]:
        p = c["predicted"]
        recompute = (per_token - attn) / 3 + attn / 3 if c["remat"] == "full" else 0.0
        assert p["compute_s"] == pytest.approx(tokens * (per_token + recompute) / (459e12 * eff), rel=1e-3)
        wire = analytic_communication(candidate_config(cfg, c), c["strategy"], tuple(c["mesh"].values()), 1)[
            "total_wire_bytes"
        ]
        assert p["comm_s"] == pytest.approx(wire / (600e9 * ici), rel=1e-3, abs=1e-9)
        assert p["mfu"] == pytest.approx(tokens * per_token / p["step_s"] / 459e12, rel=2e-3)
    speeds = [c["predicted"]["tokens_per_s_per_gpu"] for c in doc["candidates"]]
    assert speeds == sorted(speeds, reverse=True)
    assert "tok/s/chip" in format_search(doc)
    # the same grid on H100 predicts other figures: the ranking above is not H100's
    h100 = se.search(
        cfg, 8, GRID, se.Limits(device_memory=10**12, max_compiles=0), target=targets.make_target("h100", devices=8)
    )
    assert h100["candidates"][0]["predicted"]["compute_s"] < doc["candidates"][0]["predicted"]["compute_s"]


def test_tpu_slices_without_a_published_network_rank_by_the_analytic_cost():
    from fsdp_jax.targets import gpu as targets

    name, note = se.ranking_target(targets.make_target("v6e", devices=16, slices=2))
    assert name == "h100" and "v6e publishes no data-center network bandwidth" in note
    assert se.ranking_target(targets.make_target("v5p", devices=16, slices=2)) == ("v5p", None)
    assert se.ranking_target(targets.make_target("v6e", devices=8)) == ("v6e", None)
    assert se.ranking_target(None)[0] == "h100"


@pytest.mark.slow
def test_offload_candidates_compile_on_a_gpu_target(cfg):
    """On a GPU target an optimizer-offload candidate is compiled (the step without offload
    compiled for 8 x H100, its device side planned from it: fsdp_jax.app.planner.target_offload),
    not judged by the analytic model alone: the same compiled arguments as the offload-free
    candidate, minus the optimizer state resting on the host."""
    from fsdp_jax.app.planner.search_report import format_search
    from fsdp_jax.app.planner.target_offload import BASIS
    from fsdp_jax.targets import gpu as targets

    assert targets.plugin_installed(), f"run `{INSTALL_HINT}` (the CUDA compile-only plugin)"
    space = se.SearchSpace(
        strategies=("full_shard",), remats=("none",), microbatches=(1,), offloads=("none", "optimizer")
    )
    doc = se.search(cfg, 8, space, se.Limits(device_memory=10**12, top=2), target=targets.make_target("h100", 8))
    by = {c["offload"]: c for c in doc["candidates"]}
    assert set(by) == {"none", "optimizer"} and doc["counts"]["compiled"] == 2
    plain, off = by["none"], by["optimizer"]
    assert off["compilable"] and off["compiled"]["platform"] == "gpu" and off["compiled"]["basis"] == BASIS
    assert plain["compiled"]["basis"] == "compiled"
    host = off["analytic"]["host"]
    assert host > 0 and off["compiled"]["argument"] == plain["compiled"]["argument"]
    assert off["device_peak"] == off["compiled"]["device_peak"] < plain["compiled"]["device_peak"]
    assert off["compiled"]["device_peak"] > plain["compiled"]["device_peak"] - host  # + its transient copies
    assert "offload candidates compile for the GPU target" in " ".join(doc["notes"])
    doc["winner"] = off
    assert "the target's compile of this step without offload" in format_search(doc)


def _compiled_result(ops: list, peak: int = 10**6) -> dict:
    """A target compile's result as `search_compile` returns it, with the program's ops."""
    mem = {k: peak for k in ("argument", "temp", "peak", "device_peak")}
    comm = {"all-gather": {"wire_bytes": 7 * 2**24, "cross_host_wire_bytes": 0}, "total_wire_bytes": 7 * 2**24}
    return {
        "compiled": mem,
        "compile_s": 1.0,
        "platform": "gpu",
        "warnings": [],
        "communication": comm,
        "op_inventory": ops,
    }


def test_a_compiled_candidate_is_ranked_by_the_step_plan_reports(cfg):
    """Once compiled for a target, a candidate's predicted step is `step_time.predict` over its
    program's ops: the figure `plan --target` prints for that config (estimate.py predicts each
    strategy so), not the roofline; the ranking follows it. Hand-built program: a GEMM of
    4096^3 and an all-gather of 32 MB over 8 GPUs with nothing scheduled under it."""
    from fsdp_jax.app.planner import step_time
    from fsdp_jax.app.planner.search_rounds import apply_compiled
    from fsdp_jax.hlo.costs import op_inventory

    hlo = (
        "HloModule m, is_scheduled=true\n\nENTRY %main (p0: bf16[4096,4096], p1: bf16[4096,4096]) -> bf16[32768,4096] {\n"
        "  %p0 = bf16[4096,4096]{1,0} parameter(0)\n  %p1 = bf16[4096,4096]{1,0} parameter(1)\n"
        "  %dot.1 = bf16[4096,4096]{1,0} dot(%p0, %p1), lhs_contracting_dims={1}, rhs_contracting_dims={0}\n"
        "  %ag = bf16[32768,4096]{1,0} all-gather-start(%dot.1), channel_id=1, replica_groups=[1,8]<=[8], "
        "dimensions={0}, use_global_device_ids=true\n"
        "  ROOT %agd = bf16[32768,4096]{1,0} all-gather-done(%ag)\n}\n"
    )
    ops = op_inventory(hlo, [0] * 8)
    assert {o["kind"] for o in ops} == {"gemm", "collective"}
    cands = _cands(cfg, se.Limits(device_memory=10**12))
    first, second = se.rank(cands)[:2]
    analytic = dict(first["predicted"])
    assert analytic["model"] == "roofline"
    r = _compiled_result(ops)
    apply_compiled(cfg, first, r, se.Limits(device_memory=10**12), 8, "h100")
    plan_says = step_time.predict(candidate_config(cfg, first), "h100", 8, r)  # estimate.py: plan's figure
    assert plan_says["model"] == "ops"
    p = first["predicted"]
    assert p["source"] == "compiled" and p["model"] == "ops"
    assert p["step_s"] == plan_says["step_s"] and p["breakdown"] == plan_says["breakdown"]
    assert p["tokens_per_s_per_gpu"] == plan_says["tokens_per_s_per_gpu"]
    # the exposed gather makes the compiled step slower than the roofline's: it drops below the second
    assert p["step_s"] > analytic["step_s"] and p["breakdown"]["exposed_comm"] > 0
    if p["tokens_per_s_per_gpu"] < second["predicted"]["tokens_per_s_per_gpu"]:
        assert se.rank(cands).index(first) > se.rank(cands).index(second)


@pytest.mark.slow
def test_search_on_a_gpu_target_reports_plans_own_prediction(cfg, capsys):
    """End to end on 8 x H100 (deviceless XLA:GPU): the search's compiled winner carries the
    same predicted step as `plan --target h100` for the winner's overrides."""
    from fsdp_jax.targets import gpu as targets

    assert targets.plugin_installed(), f"run `{INSTALL_HINT}` (the CUDA compile-only plugin)"
    space = se.SearchSpace(strategies=("full_shard",), remats=("none",), microbatches=(1,), offloads=("none",))
    doc = se.search(cfg, 8, space, se.Limits(device_memory=10**12, top=1), target=targets.make_target("h100", 8))
    w = doc["winner"]
    assert w["compiled"] is not None and w["predicted"]["source"] == "compiled" and w["predicted"]["model"] == "ops"
    over = [o for o in w["overrides"] if not o.startswith("mesh.strategy=")]
    rc, out, err = call(
        "plan.py", "--config", TINY_YAML, "--target", "h100", "--devices", "8", "--strategies", "full_shard",
        "--json", *SMALL, *over, capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err[-2000:]
    planned = json.loads(out)["strategies"]["full_shard"]["predicted"]
    assert w["predicted"]["step_s"] == pytest.approx(planned["step_s"], rel=1e-3)
    assert w["predicted"]["breakdown"] == pytest.approx(planned["breakdown"], rel=1e-3, abs=1e-9)


def test_the_search_tries_the_targets_attention_kernels(cfg, capsys):
    """XLA's attention and the target's flash kernel (cuDNN on a GPU with bf16 compute, splash on
    a TPU) are a dim of the space: each candidate twice, the flash twin's analytic activations
    without the S x S logits, its overrides naming the kernel; without a target, the config's."""
    from fsdp_jax.app.planner.search_space import attention_kernels
    from fsdp_jax.targets import gpu as targets

    assert cfg.model.attention == "xla"
    assert attention_kernels(cfg, "gpu") == ("xla", "cudnn") and attention_kernels(cfg, "tpu") == ("xla", "splash")
    assert attention_kernels(cfg, None) == ("xla",)
    f32 = dataclasses.replace(cfg, precision="params=float32,compute=float32")
    assert attention_kernels(f32, "gpu") == ("xla",)  # cuDNN's flash attention has no f32 kernel
    space = dataclasses.replace(GRID, attentions=("xla", "cudnn"))
    doc = se.search(
        cfg, 8, space, se.Limits(device_memory=10**12, max_compiles=0), target=targets.make_target("h100", 8)
    )
    cands = doc["candidates"]
    assert doc["space"]["attentions"] == ["xla", "cudnn"]
    assert len(cands) == 2 * len(se.enumerate_candidates(cfg, 8, GRID, lambda s: mesh_shape(cfg, s, 8))[0])
    key = lambda c: (c["strategy"], c["remat"], c["microbatches"])  # noqa: E731
    twins = {(key(c), c["attention"]): c for c in cands}
    for (k, att), c in twins.items():
        if att == "cudnn":
            assert "model.attention=cudnn" in c["overrides"]
            assert c["analytic"]["activations"] < twins[(k, "xla")]["analytic"]["activations"]
        else:
            assert not any(o.startswith("model.attention=") for o in c["overrides"])
    rc, out, err = call(
        "plan.py", "--config", TINY_YAML, "--target", "h100", "--devices", "8", "--search", "--max-compiles", "0",
        "--offload", "none", "--json", *SMALL, capsys=capsys,
    )  # fmt: skip
    assert rc == 0, err
    got = json.loads(out)
    assert got["space"]["attentions"] == ["xla", "cudnn"] and {c["attention"] for c in got["candidates"]} == {
        "xla",
        "cudnn",
    }


def test_search_costs_fp8_weight_gathers_and_delayed_histories(cfg):
    """The search under matmul=fp8 (delayed, fp8.gather unset = on): ZeRO-3's two per-layer
    gathers move the layers' params in f8, 1 byte each against bf16's 2 (P8 in 3P -> 2 P8 + P),
    by hand from the tiny model's shapes; the strategies that do not gather per layer, and
    fp8.gather=false, send bf16's bytes; a full_shard candidate's predicted communication
    shrinks with it; its roofline runs the layers' GEMMs at H100's FP8 peak (1979 TFLOP/s against
    989: 6 x layer params FLOPs per token, 8 with full remat's second forward, at half the time);
    and its memory holds the histories (7 projections x layers x (2 + 1) histories of L float32)
    beside the optimizer state."""
    from fsdp_jax.targets.perf_tables import perf_table

    t = perf_table("h100")
    peak, peak8, eff = t["peak_flops"]["bf16"], t["peak_flops"]["f8e4m3fn"], t["gemm"]["max_efficiency"]
    fp8 = [*SMALL, "precision=params=float32,compute=bfloat16,matmul=fp8", "fp8.recipe=delayed", "fp8.emulate=true"]
    on, off = load_config(TINY_YAML, fp8), load_config(TINY_YAML, [*fp8, "fp8.gather=false"])
    m = cfg.model
    q, k = m.n_heads * m.head_dim, m.n_kv_heads * m.head_dim
    layer = m.d_model * (q + 2 * k) + q * m.d_model + 2 * m.d_model + 3 * m.d_model * m.ffn_dim  # + 2 norms
    saved = 2 * m.n_layers * layer * (2 - 1) * 7 / 8  # two gathers per step, 1 byte each fewer, ring over 8
    limits = se.Limits(device_memory=10**12)
    hist = 7 * m.n_layers * 3 * on.fp8.amax_history * 4
    for c_on, c_off, c_bf in zip(_cands(on, limits), _cands(off, limits), _cands(cfg, limits)):
        assert (c_on["strategy"], c_on["remat"], c_on["microbatches"]) == (
            c_off["strategy"],
            c_off["remat"],
            c_off["microbatches"],
        )
        w = [
            analytic_communication(candidate_config(x, c_on), c_on["strategy"], (1, 8, 1), 1)["total_wire_bytes"]
            for x in (on, off, cfg)
        ]
        per_layer = c_on["strategy"] == "full_shard"
        assert w[1] == w[2] and w[1] - w[0] == (int(saved * c_on["microbatches"]) if per_layer else 0), (
            c_on["strategy"],
            w,
        )
        assert (c_on["predicted"]["comm_s"] < c_off["predicted"]["comm_s"]) == per_layer
        assert c_on["analytic"]["optimizer"] - c_bf["analytic"]["optimizer"] == hist
        f8 = 6 * m.n_layers * layer * (4 / 3 if c_on["remat"] == "full" else 1)  # FP8 FLOPs per token
        tokens = c_on["seq_len"] * c_on["global_batch"] / 8
        want = c_bf["predicted"]["compute_s"] - tokens * f8 * (1 / peak - 1 / peak8) / eff
        assert c_on["predicted"]["compute_s"] == pytest.approx(want, rel=2e-3), c_on["remat"]
