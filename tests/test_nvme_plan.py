"""The planner's nvme offload (`fsdp_jax.app.planner.nvme_plan`): disk and host-buffer bytes
held against the layer files the trainer's nvme step writes (`fsdp_jax.nvme.Layout`), the
device side against the compile of the step without offload, the disk time in the step, the
search leaving nvme out where it cannot run, and the CLI's bad input."""

import dataclasses
import json

import jax
import pytest
from test_plan import TINY_YAML

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.planner import nvme_plan
from fsdp_jax.app.planner.abstract_step import build_step
from fsdp_jax.app.planner.estimate import format_offload_table, plan_config
from fsdp_jax.app.planner.flag_values import parse_bytes
from fsdp_jax.app.planner.memory_model import analytic_memory
from fsdp_jax.app.planner.report import fmt_bytes
from fsdp_jax.app.planner.search_space import SearchSpace, overrides
from fsdp_jax.app.planner.step_time import roofline_constants
from fsdp_jax.checkpoint import direct_io
from fsdp_jax.nvme import HOST_BUFFERS, LAYERED, Layout, labels_of
from helpers import TINY_MODEL_OVERRIDES, call, one_line

NVME = "optimizer:nvme"


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    run = tmp_path_factory.mktemp("run")
    return load_config(TINY_YAML, [*TINY_MODEL_OVERRIDES, "train.steps=10", f"run_dir={run}", f"offload={NVME}"])


@pytest.fixture(scope="module")
def plans(cfg):
    """One compile: full_shard planned with and without the nvme offload."""
    none = plan_config(dataclasses.replace(cfg, offload="none"), 8, "full_shard", device_memory=parse_bytes("1GB"))
    nvme = plan_config(cfg, 8, "full_shard", device_memory=parse_bytes("1GB"))
    return none["strategies"]["full_shard"], nvme["strategies"]["full_shard"], {"none": none, NVME: nvme}


def _files(cfg):
    """The layer-file layout the nvme step writes for this config (one process, 8 devices)."""
    b = build_step(cfg, "full_shard")
    labels = labels_of(b.optimizer, b.state.opt_state, b.plan.layered)
    stored = [x for x, m in zip(jax.tree.leaves(b.state.opt_state), jax.tree.leaves(labels)) if m == LAYERED]
    return Layout.of(stored)


@pytest.mark.slow
def test_disk_and_host_buffers_are_the_files_the_step_writes(cfg, plans):
    layout = _files(cfg)
    a = plans[1]["analytic"]
    files = layout.n_layers * layout.nbytes  # this process's files: the host's 8 devices
    padding = len(layout.entries) * direct_io.ALIGN  # each shard starts page-aligned
    assert 0 <= files - a["disk_per_host"] <= layout.n_layers * padding
    assert 0 <= HOST_BUFFERS * layout.nbytes - a["host_per_host"] <= HOST_BUFFERS * padding
    assert a["disk_per_step"] == 2 * a["disk_per_host"]  # each layer read once, written once
    assert a["transfer_per_step"] == 2 * a["disk"]
    # a checkpoint streams through two of the step's layer buffers (`checkpoint_stream.StackWriter`)
    assert 0 <= 2 * layout.nbytes - a["checkpoint_host_per_host"] <= 2 * padding


def test_device_side_is_the_step_without_offload_less_the_stored_state(plans):
    none, nvme, docs = plans
    a0, a = none["analytic"], nvme["analytic"]
    layer = -(-a["disk"] // 2)  # the tiny model: 2 layers
    assert a["disk"] < a0["optimizer"]  # the unstacked leaves' state stays on the device
    assert a["device_total"] == a0["total"] - a["disk"] + 2 * layer
    c0, c = none["compiled"], nvme["compiled"]
    assert c["peak"] == c0["peak"]  # the same program
    assert c["device_peak"] == c0["peak"] - a["disk"] + 2 * layer
    assert c["device_argument"] == c0["argument"] - a["disk"]
    assert any("optimizer:nvme" in w for w in nvme["warnings"])
    assert any("streams the stacked state layer by layer" in w for w in nvme["warnings"])
    rows = {line.split()[1]: line for line in format_offload_table(docs).splitlines() if "full_shard" in line}
    assert rows["none"].split()[-2] == "-" and fmt_bytes(a["disk_per_host"]) in rows[NVME]  # the disk/host column


PARAMS = "optimizer+params:nvme"


def test_params_on_disk_count_the_params_in_the_files_and_their_reads(cfg, plans):
    """`optimizer+params:nvme`: the files hold the stacked optimizer state, the
    stacked f32 params and their grads (held against the layouts the step's files would have);
    the forward and backward read the params once each, the backward writes the grads, the update
    reads params, state and grads and writes params and state; the device keeps none of them, nor
    the stacked grads, beyond two layers."""
    b = build_step(cfg, "full_shard")
    none = analytic_memory(dataclasses.replace(b, cfg=dataclasses.replace(cfg, offload="none")))
    a = analytic_memory(dataclasses.replace(b, cfg=dataclasses.replace(cfg, offload=PARAMS)))
    state = _files(cfg)
    stacked = [x for x, m in zip(jax.tree.leaves(b.state.params), jax.tree.leaves(b.plan.layered)) if m]
    params = Layout.of(stacked)  # the grads: f32 here (reduce=float32), the same layout
    layers = params.n_layers
    pad = (len(state.entries) + 2 * len(params.entries)) * direct_io.ALIGN
    assert 0 <= layers * (state.nbytes + 2 * params.nbytes) - a["disk_per_host"] <= layers * pad
    assert 0 <= layers * params.nbytes - a["disk_params_per_host"] <= layers * len(params.entries) * direct_io.ALIGN
    p_host = a["disk_params_per_host"]
    s_host = a["disk_per_host"] - 2 * p_host
    assert a["disk_per_step"] == 4 * p_host + 2 * s_host + 2 * p_host
    assert a["disk_forward"] == p_host and a["disk_backward"] == 2 * p_host
    p_dev = sum(_shard_bytes(x) for x in stacked)
    s_dev = plans[1]["analytic"]["disk"]  # the state: as under optimizer:nvme
    assert a["disk"] == s_dev + 2 * p_dev
    assert a["transfer_per_step"] == 4 * p_dev + 2 * s_dev + 2 * p_dev
    assert a["transfer_forward"] == p_dev and a["transfer_backward"] == 2 * p_dev
    off = s_dev + p_dev + none["grads"] * p_dev // none["params"]  # + the stacked params' grads
    assert a["off_device"] == off
    assert a["device_total"] == none["total"] - off + 2 * -(-off // layers)
    assert none["grads"] == none["params"]  # f32 grads of f32 params here: G == P
    assert 0 <= HOST_BUFFERS * (state.nbytes + 2 * params.nbytes) - a["host_per_host"] <= HOST_BUFFERS * pad
    r = {"analytic": a, "compiled": dict(plans[0]["compiled"]), "offload": PARAMS, "warnings": []}
    c = nvme_plan.complete_compiled(r)["compiled"]
    off_c = s_dev + 2 * p_dev  # the compiled step's grads of them: f32 (reduce=float32), as the params
    assert a["off_device_compiled"] == off_c and a["stored_layers"] == layers
    assert c["device_peak"] == plans[0]["compiled"]["peak"] - off_c + 2 * -(-off_c // layers)
    assert c["device_argument"] == plans[0]["compiled"]["argument"] - s_dev - p_dev  # the grads were no argument
    assert "a layer at a time by the trainer's layer-wise step" in r["warnings"][0]


def _shard_bytes(x):
    n = 1
    for d in x.sharding.shard_shape(x.shape):
        n *= d
    return n * x.dtype.itemsize


def test_params_reads_overlap_the_compute_they_feed():
    """With the params on disk the forward and the backward each take the slower of their compute
    and their I/O; the update's I/O after the backward waits."""
    a = {"disk_per_step": 50e9, "disk_forward": 10e9, "disk_backward": 20e9}
    a.update(transfer_per_step=10e9, transfer_forward=2e9, transfer_backward=4e9, forward_share=0.25)
    io = nvme_plan.io_seconds(a, 50e9, 25e9, compute_s=4.0)  # forward 1 s vs 0.4 s read; backward 3 vs 0.8
    assert io["disk_s"] == 2.0 and io["io_s"] == pytest.approx(0.8)  # the update: 20 GB of disk
    io = nvme_plan.io_seconds(a, 50e9, 5e9, compute_s=4.0)  # forward 2 s, backward 4 s, update 4 s of I/O
    assert io["io_s"] == pytest.approx((2.0 - 1.0) + (4.0 - 3.0) + 4.0)
    slow_link = nvme_plan.io_seconds(a, 1e9, 25e9, compute_s=4.0)  # the link: 2, 4 and 4 s
    assert slow_link["io_s"] == pytest.approx((2.0 - 1.0) + (4.0 - 3.0) + 4.0)


def test_io_seconds_are_the_slower_of_disk_and_host_link_added_to_the_step():
    analytic = {"disk_per_step": 50e9, "transfer_per_step": 10e9}
    p = {"step_s": 1.0, "band_s": [0.85, 1.15], "tokens_per_s_per_gpu": 300.0, "tflops_per_gpu": 90.0, "mfu": 0.09}
    nvme_plan.add_io(p, analytic, "h100", None)  # the h100 table: 25 GB/s of disk, 50 GB/s of host link
    assert p["io"]["disk_s"] == 2.0 and p["io"]["host_s"] == 0.2 and p["io"]["io_s"] == 2.0
    assert p["step_s"] == 3.0 and p["tokens_per_s_per_gpu"] == 100.0 and p["band_s"] == [2.85, 3.15]
    q = {"step_s": 1.0, "tokens_per_s_per_gpu": 300.0, "tflops_per_gpu": 90.0, "mfu": 0.09}
    nvme_plan.add_io(q, analytic, "h100", 100e9)  # --disk-gbps 100: the disk no longer the slower
    assert q["io"]["io_s"] == 0.5 and q["io"]["disk_source"] == "--disk-gbps"


def test_search_leaves_nvme_out_where_it_cannot_run(cfg):
    assert nvme_plan.search_refusal(cfg, "h100", None) is None
    assert "disk" in nvme_plan.search_refusal(cfg, "v5p", None)  # no disk figure for a TPU host
    assert nvme_plan.search_refusal(cfg, "v5p", 10e9) is None
    ada = dataclasses.replace(cfg, optimizer=dataclasses.replace(cfg.optimizer, name="adafactor"))
    assert "elementwise" in nvme_plan.search_refusal(ada, "h100", None)
    flat = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, scan_layers=False))
    assert "scan_layers" in nvme_plan.search_refusal(flat, "h100", None)
    assert NVME in SearchSpace().offloads
    c = {"strategy": "full_shard", "remat": "full", "microbatches": 1, "offload": NVME}
    c.update(global_batch=cfg.train.global_batch, seq_len=cfg.data.seq_len)
    bare = dataclasses.replace(cfg, offload_dirs="")
    assert any(o.startswith("offload_dirs=") for o in overrides(bare, c))  # the winner's YAML trains


@pytest.mark.parametrize(
    "args,needle",
    [
        (["--offload", NVME, "--disk-gbps", "-1"], "--disk-gbps"),
        (["--offload", "optimizer:disk"], "optimizer:disk"),
        (["--target", "v5p-8", "--devices", "4", "--offload", NVME], "--disk-gbps"),
    ],
)
def test_bad_input_exits_2_with_one_line(args, needle, capsys):
    rc, out, err = call("plan", "--config", TINY_YAML, "--devices", "8", *args, capsys=capsys)
    one_line(rc, err, needle)
    assert out == ""


def test_plan_json_carries_the_disk_terms(capsys, tmp_path):
    rc, out, err = call(
        "plan",
        "--config",
        TINY_YAML,
        "--devices",
        "8",
        "--strategies",
        "full_shard",
        "--offload",
        NVME,
        "--json",
        *TINY_MODEL_OVERRIDES,
        f"run_dir={tmp_path}",
        capsys=capsys,
    )
    assert rc == 0, err
    a = json.loads(out)["strategies"]["full_shard"]["analytic"]
    assert a["disk"] > 0 and a["disk_per_step"] == 2 * a["disk_per_host"] and a["host_per_host"] > 0


def test_search_ranks_nvme_with_its_disk_time_added(capsys, tmp_path):
    """Analytic only: an nvme candidate's step is the same candidate's without offload plus its
    I/O (the disk's, or the host link's where slower), and its device total the stacked state
    less two layers of it."""
    rc, out, err = call(
        "plan",
        "--config",
        TINY_YAML,
        "--devices",
        "8",
        "--search",
        "--max-compiles",
        "0",
        "--device-memory",
        "1GB",
        "--strategies",
        "full_shard",
        "--remat",
        "full",
        "--microbatches",
        "1",
        "--offload",
        f"none,{NVME},{PARAMS}",
        "--disk-gbps",
        "0.001",
        "--json",
        *TINY_MODEL_OVERRIDES,
        f"run_dir={tmp_path}",
        capsys=capsys,
    )
    assert rc == 0, err
    doc = json.loads(out)
    by = {c["offload"]: c for c in doc["candidates"]}
    none, nvme = by["none"], by[NVME]
    a, p = nvme["analytic"], nvme["predicted"]
    assert p["disk_s"] == pytest.approx(a["disk_per_step"] / 1e6, rel=1e-3)  # 0.001 GB/s
    assert p["step_s"] == pytest.approx(none["predicted"]["step_s"] + p["disk_s"], rel=1e-3)
    assert a["device_total"] == none["analytic"]["device_total"] - a["disk"] + 2 * -(-a["disk"] // 2)  # 2 layers
    assert doc["winner"]["offload"] == "none"  # the disk's seconds rank it below
    # params on disk: named in --offload, searched; its reads overlap the compute they feed
    pa, pp = by[PARAMS]["analytic"], by[PARAMS]["predicted"]
    compute = none["predicted"]["step_s"]
    io = nvme_plan.io_seconds(pa, roofline_constants("h100")["host"], 1e6, compute)
    assert pp["step_s"] == pytest.approx(compute + io["io_s"], rel=1e-3) and io["io_s"] > p["disk_s"] / 2
    assert pa["disk"] > a["disk"] and pa["disk_per_step"] > a["disk_per_step"]  # the params in the files too
    assert any("nvme candidates" in n and "--disk-gbps" in n for n in doc["notes"])
