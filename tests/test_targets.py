"""Deviceless compiles for real GPU targets (fsdp_jax.targets.gpu): the reference decoder at test
size compiled by XLA:GPU for 8 x H100 (and 2 hosts x 4) shows the FSDP collective pattern
the strategies promise, the memory the planner predicts, and no extra state copy from the
non-finite guard. XLA:CPU cannot show any of this (no reduce-scatter, bf16 upcast).

The CUDA compile-only plugin is installed by README's set-up command
(`python -m fsdp_jax.targets install`) into a private folder; without it these tests FAIL
(they do not skip), naming that command. All GPU compiles run in one child process
(module-scoped fixture `gpu`), the only process that sees the plugin."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jax
import pytest

from fsdp_jax.hlo import schedule as hlo
from fsdp_jax.hlo.findings import involuntary_rematerializations, schedule_warnings
from fsdp_jax.targets import gpu as targets
from helpers import TINY_MODEL_OVERRIDES, call, one_line

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"
# configs/tiny.yaml shrunk to compile in seconds; 2 scanned layers
SMALL = [*TINY_MODEL_OVERRIDES, "train.steps=10"]
BF16 = "precision=params=float32,compute=bfloat16,reduce=bfloat16"
# Compiled peak / analytic total - 1, measured on the jobs below (h100 x 8, bf16 compute,
# remat dots), jax 0.10.2 / 0.12.0.1: full_shard +1.4% / +2.6%, shard_grad_op +5.1% / +5.7%,
# no_shard +2.2% / +5.9%, hybrid_shard +2.0% / +3.1%. At full size (7B on 8 x H100,
# full_shard and shard_grad_op, xla and cudnn attention, remat full and dots): -6.1% to
# +2.4% (BENCHMARKS.md, "Analytic memory against the GPU compile").
PEAK_TOLERANCE = 0.10

WIDE = [
    "model.d_model=4096",
    "model.n_heads=32",
    "model.n_kv_heads=32",
    "model.ffn_dim=11008",
    "model.vocab_size=4096",
    "model.max_seq_len=1024",
    "data.seq_len=1024",
    "train.global_batch=8",
]
ONE_IN_FLIGHT = "xla_gpu_experimental_parallel_collective_overlap_limit"
COMBINE = "xla_gpu_reduce_scatter_combine_threshold_bytes"
REDUCE_F32 = "precision=params=float32,compute=bfloat16,reduce=float32"
# name -> (strategy, hosts, gpus_per_host, overrides, step options[, compiler options])
JOBS = {
    "full_shard": ("full_shard", 1, 8, [BF16], {}),
    "full_shard_f32": ("full_shard", 1, 8, ["precision=float32"], {}),
    "full_shard_reduce_f32": ("full_shard", 1, 8, ["precision=params=float32,compute=bfloat16,reduce=float32"], {}),
    "shard_grad_op": ("shard_grad_op", 1, 8, [BF16], {}),
    "shard_grad_op_reduce_f32": (
        "shard_grad_op",
        1,
        8,
        ["precision=params=float32,compute=bfloat16,reduce=float32"],
        {},
    ),
    "shard_opt": ("shard_opt", 1, 8, [BF16], {}),
    "no_shard": ("no_shard", 1, 8, [BF16], {}),
    "no_shard_unguarded": ("no_shard", 1, 8, [BF16], {"skip_nonfinite": False}),
    "hybrid_shard": ("hybrid_shard", 2, 4, [BF16], {}),
    "full_shard_offload_opt": ("full_shard", 1, 8, [BF16, "offload=optimizer"], {}),
    # Llama-2-7B's layer shape (2 layers, seq 1024): big enough for XLA's latency estimates to
    # leave gathers exposed; with the step's compile options (fsdp_jax.targets.xla_flags) and with
    # XLA's default of one collective in flight
    "full_shard_wide": ("full_shard", 1, 8, [BF16] + WIDE, {}),
    "full_shard_wide_one_in_flight": ("full_shard", 1, 8, [BF16] + WIDE, {}, {ONE_IN_FLIGHT: 1}),
    # and with XLA's own reduce-scatter combining (a layer's bf16 weight-grad scatters as one)
    "full_shard_wide_combined": ("full_shard", 1, 8, [BF16] + WIDE, {}, {COMBINE: 128 << 20}),
    # the same layer shape under hybrid_shard (2 hosts x 4) with f32 grad reductions and remat
    # full (Llama-2-7B's config): each weight's reduce-scatter + cross-host all-reduce; with the
    # step's compile options and with the two in flight these steps compiled with before
    "hybrid_wide": ("hybrid_shard", 2, 4, [REDUCE_F32, "remat=full"] + WIDE, {}),
    "hybrid_wide_two_in_flight": ("hybrid_shard", 2, 4, [REDUCE_F32, "remat=full"] + WIDE, {}, {ONE_IN_FLIGHT: 2}),
}

_CHILD = r"""
import json, sys
from fsdp_jax.targets import gpu as targets
from fsdp_jax.app.config import load_config
from fsdp_jax.app.planner.one_strategy import plan_strategy
from fsdp_jax.app.planner.abstract_step import target_mesh_sizes
req = json.loads(sys.stdin.read())
out = {"targets": {}}
for name in targets.target_names("gpu"):   # every shipped GPU target config parses on this jax
    devs = targets.gpu_devices(name, 1, 2)
    out["targets"][name] = devs[0].device_kind
devices = {}
for name, (strategy, hosts, per, overrides, opts, *copts) in req["jobs"].items():
    cfg = load_config(req["config"], req["small"] + overrides)
    key = (hosts, per)
    if key not in devices:
        devices[key] = targets.gpu_devices("h100", hosts, per)
    devs = devices[key]
    out[name] = plan_strategy(cfg, strategy, devs, inspect=True, step_options=opts,
                              compiler_options=copts[0] if copts else None,
                              mesh_sizes=target_mesh_sizes(cfg, strategy, len(devs), hosts))
    out[name]["hosts_of_devices"] = [d.process_index for d in devs]
# the jobs may be read back from the suite's compile cache (fsdp_jax.targets.compile_cache): one
# program compiled here in any case, so XLA:GPU's kernel cache file is written by this jaxlib
import jax, jax.numpy as jnp
x = jax.ShapeDtypeStruct((256, 256), jnp.float32, sharding=jax.sharding.SingleDeviceSharding(devs[0]))
jax.jit(lambda a: jnp.tanh(a @ a) + 1.0).lower(x).compile()
json.dump(out, sys.stdout)
"""


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    """Compile every job of JOBS for H100 targets in one child process (XLA:GPU's kernel
    cache in a file of its own: later jobs reuse earlier jobs' kernels); its results."""
    assert targets.plugin_installed(), (
        f"the CUDA compile-only plugin is not installed in {targets.plugin_dir()}: run "
        f"`python -m fsdp_jax.targets install` (README's set-up command does); if it fails, no "
        f"jax-cuda12-plugin matches this jax and GPU-target compiles are unavailable"
    )
    req = {"config": str(TINY_YAML), "small": SMALL, "jobs": JOBS}
    kernels = tmp_path_factory.mktemp("xla_gpu") / "kernels.bin"
    proc = subprocess.run(
        [sys.executable, "-c", _CHILD],
        input=json.dumps(req),
        capture_output=True,
        text=True,
        env=targets.child_env(dict(os.environ, PYTHONPATH=str(ROOT)), kernel_cache=kernels),
        cwd=ROOT,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return dict(json.loads(proc.stdout), kernel_cache_bytes=kernels.stat().st_size if kernels.exists() else 0)


def _colls(r, op, **where):
    return [c for c in r["schedule"] if c["op"] == op and all(c[k] == v for k, v in where.items())]


def _param_sized(r, op):
    """Collectives of `op` that move parameters (not norm scales or loss scalars)."""
    return [c for c in _colls(r, op) if c["bytes"] >= 4096]


# ----------------------------------------------------------------------------- targets, plugin

slow = pytest.mark.slow


@slow
def test_every_target_config_parses_on_this_jax(gpu):
    pcie = {"rtx4090", "rtx3090", "l4", "l40s", "a10g"}
    assert set(gpu["targets"]) == set(targets.target_names("gpu")) == {"h100", "h200", "a100"} | pcie
    assert "H100" in gpu["targets"]["h100"] and "A100" in gpu["targets"]["a100"]
    assert "RTX 4090" in gpu["targets"]["rtx4090"] and "L40S" in gpu["targets"]["l40s"]


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (
            {"name": "h999", "devices": 8},
            "--target: unknown GPU target 'h999'; known: a100, a10g, h100, h200, l4, l40s, rtx3090, rtx4090",
        ),
        ({"name": "h100", "devices": 8, "hosts": 3}, "--hosts: 8 devices do not divide into 3 hosts"),
        ({"name": "h100", "devices": 8, "hosts": 2, "gpus_per_host": 8}, "--devices: 8 is not --hosts (2)"),
        ({"name": "h100", "devices": 0}, "--devices: 0 must be a positive integer"),
        ({"name": "h100", "hosts": 2}, "--devices: give the total number"),
    ],
)
def test_bad_target_requests_name_the_flag(kwargs, needle):
    with pytest.raises(targets.TargetError, match=None) as e:
        targets.make_target(**kwargs)
    assert needle in str(e.value)


def test_topology_is_host_major():
    t = targets.make_target("h200", devices=64, hosts=8)
    assert (t.hosts, t.gpus_per_host, t.topology) == (8, 8, "1x8x8")
    assert targets.device_memory("h200") > 140e9 > targets.device_memory("h100") > 80e9


@slow
def test_child_env_names_a_kernel_cache_only_when_asked(tmp_path, gpu):
    flag = targets.KERNEL_CACHE_FLAG
    assert flag not in targets.child_env({"XLA_FLAGS": "--xla_dump_to=/x"}).get("XLA_FLAGS", "")
    env = targets.child_env({"XLA_FLAGS": "--xla_dump_to=/x"}, kernel_cache=tmp_path / "k.bin")
    assert env["XLA_FLAGS"] == f"--xla_dump_to=/x {flag}={tmp_path / 'k.bin'}"
    mine = f"{flag}={tmp_path / 'mine.bin'}"
    assert targets.child_env({"XLA_FLAGS": mine}, kernel_cache=tmp_path / "k.bin")["XLA_FLAGS"] == mine
    off = f"--xla_dump_to=/x {flag}="  # an empty value: no cache, and none added
    assert targets.child_env({"XLA_FLAGS": off}, kernel_cache=tmp_path / "k.bin")["XLA_FLAGS"] == off
    (tmp_path / "a_file").write_text("")
    for bad in (tmp_path / "missing" / "k.bin", tmp_path / "a_file" / "k.bin"):
        with pytest.raises(targets.TargetError, match=f"its directory {bad.parent} does not exist or is not"):
            targets.child_env({"XLA_FLAGS": f"{flag}={bad}"})
    # and this jaxlib's XLA:GPU takes the flag and writes the cache (the fixture's compiles)
    assert gpu["kernel_cache_bytes"] > 0


def test_missing_plugin_names_the_install_command(monkeypatch, tmp_path):
    monkeypatch.setenv("FSDP_JAX_PLUGIN_DIR", str(tmp_path / "none"))
    with pytest.raises(targets.MissingExtra, match="python -m fsdp_jax.targets install"):
        targets.child_env()


def test_cpu_runs_never_see_the_plugin():
    """The plugin lives outside site-packages: a normal process imports jax without the
    CUDA plugin's stderr lines and finds no jax_plugins.xla_cuda12."""
    code = (
        "import importlib.util, jax; jax.devices(); "
        "print(importlib.util.find_spec('jax_plugins') is None "
        "or importlib.util.find_spec('jax_plugins.xla_cuda12') is None)"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=dict(env, JAX_PLATFORMS="cpu"), cwd="/"
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "True", proc.stderr
    assert "cuda" not in proc.stderr.lower(), proc.stderr


@pytest.mark.parametrize(
    "script, args, needle",
    [
        ("plan.py", ["--target", "h999", "--devices", "8"], "--target: unknown GPU target"),
        ("plan.py", ["--target", "h100", "--devices", "8", "--hosts", "3"], "do not divide into 3 hosts"),
        (
            "inspect.py",
            ["--target", "h100", "--devices", "8", "--hosts", "0"],
            "--hosts: 0 must be in 1..65536",
        ),
        ("plan.py", ["--devices", "8", "--hosts", "2"], "--hosts: '2' needs --target"),
        ("plan.py", ["--target", "h100", "--devices", "8", "PLUGIN_MISSING"], "python -m fsdp_jax.targets install"),
        # what compile-only GPU devices cannot do: cuDNN without its library (a compile child: slow)
        pytest.param(
            "plan.py",
            [
                "--target",
                "h100",
                "--devices",
                "8",
                "--strategies",
                "full_shard",
                "NO_CUDNN",
                "model.attention=cudnn",
                "precision=params=float32,compute=bfloat16",
            ],
            "model.attention=cudnn: NVIDIA's cuDNN library is not in the compile folder",
            marks=pytest.mark.slow,
        ),
        # XLA_FLAGS for the compiling child: a kernel cache nowhere to write, a flag XLA lacks
        (
            "plan.py",
            ["--target", "h100", "--devices", "8", "XLA_FLAGS=--xla_gpu_kernel_cache_file=/nonexistent/k.bin"],
            "XLA_FLAGS --xla_gpu_kernel_cache_file=/nonexistent/k.bin: its directory /nonexistent does not exist",
        ),
        pytest.param(  # the compile child refuses it (slow); the kernel-cache case above is refused before
            "inspect.py",
            ["--target", "h100", "--devices", "8", "--strategy", "full_shard", "XLA_FLAGS=--xla_gpu_no_such_flag=1"],
            "XLA_FLAGS: Unknown flag in XLA_FLAGS: --xla_gpu_no_such_flag=1",
            marks=pytest.mark.slow,
        ),
    ],
)
def test_scripts_bad_target_input_exit_2_with_one_line(script, args, needle, tmp_path, capsys):
    env = {}
    if "NO_CUDNN" in args:  # the plugin without the cuDNN wheel (a copy of its folder)
        args = [a for a in args if a != "NO_CUDNN"]
        shutil.copytree(
            targets.plugin_dir(), tmp_path / "plugin", ignore=shutil.ignore_patterns("nvidia", "nvidia_cudnn_cu12-*")
        )
        env["FSDP_JAX_PLUGIN_DIR"] = str(tmp_path / "plugin")
        args += SMALL
    if "PLUGIN_MISSING" in args:
        args = [a for a in args if a != "PLUGIN_MISSING"]
        env["FSDP_JAX_PLUGIN_DIR"] = str(tmp_path / "none")
    for a in [a for a in args if a.startswith("XLA_FLAGS=")]:  # the children's, after the suite's own
        args.remove(a)
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {a.removeprefix('XLA_FLAGS=')}".strip()
    rc, out, err = call(script, "--config", TINY_YAML, *args, capsys=capsys, env=env)
    one_line(rc, err, needle)
    assert out == ""


# ----------------------------------------------------------------------------- collectives


@slow
def test_full_shard_bf16_gathers_per_layer_and_reduce_scatters_in_the_backward_loop(gpu):
    r = gpu["full_shard"]
    assert r["platform"] == "gpu"
    gathers = _param_sized(r, "all-gather")
    in_loop = [c for c in gathers if c["loop"]]
    assert {c["phase"] for c in in_loop} == {"forward", "backward"}
    assert all(c["dtype"] == "bfloat16" for c in gathers), [(c["name"], c["dtype"]) for c in gathers]
    assert all(c["group_size"] == 8 for c in gathers)
    # async (start/done, so the schedule can overlap them), except the backward loop's
    # re-gather from XLA 0.12 on: at this test size its scheduler finds nothing to put
    # between start and done and emits a plain all-gather (the inspector warns about it)
    old_xla = tuple(int(x) for x in jax.__version__.split(".")[:2]) < (0, 12)
    assert all(c["async"] for c in gathers if old_xla or c["phase"] != "backward"), [
        (c["name"], c["phase"], c["async"]) for c in gathers
    ]
    if any(not c["async"] for c in gathers):
        assert any("synchronous" in w and "all-gather" in w for w in r["warnings"]), r["warnings"]
    for c in in_loop:  # once per layer, per pass
        assert c["runs"] == 2 and "while" in c["loop"]
    scatters = _colls(r, "reduce-scatter", phase="backward")
    assert scatters and all(c["dtype"] == "bfloat16" for c in scatters), r["schedule"]
    assert not _param_sized(r, "all-reduce"), "param-sized all-reduce under full_shard"
    # the gathers in the loop move one layer: bytes x runs = the stacked params in bf16
    layer_bytes = sum(c["bytes"] for c in in_loop if c["phase"] == "forward")
    stacked = sum(x["total_bytes"] // 2 for x in r["rows"] if len(x["shape"]) >= 3)  # f32 -> bf16
    assert layer_bytes * 2 == stacked
    # and the backward loop reduce-scatters that layer's grads (a scatter's result is the
    # 1/8 shard); the unstacked embedding's grad may be scattered after the loop
    assert sum(c["bytes"] for c in scatters if c["loop"]) * 8 == layer_bytes, r["schedule"]


@slow
@pytest.mark.parametrize("job", ["full_shard_reduce_f32", "shard_grad_op_reduce_f32"])
def test_reduce_float32_reduce_scatters_in_float32(gpu, job):
    """PyTorch FSDP's reduce_dtype=float32 under bf16 compute: weight grads are summed across
    devices in f32 (fsdp_jax.sharding.precision.matmul / take), the gathers still move bf16, and the
    per-layer scatter moves twice the bf16 run's bytes."""
    r, bf16 = gpu[job], gpu[job.removesuffix("_reduce_f32")]
    scatters = _colls(r, "reduce-scatter", phase="backward")
    assert scatters and all(c["dtype"] == "float32" for c in scatters), r["schedule"]
    assert all(c["dtype"] == "bfloat16" for c in _param_sized(r, "all-gather"))
    assert not _param_sized(r, "all-reduce"), "param-sized all-reduce under " + job

    def in_loop(x):
        return sum(c["bytes"] for c in _colls(x, "reduce-scatter", phase="backward") if c["loop"])

    assert in_loop(r) == 2 * in_loop(bf16) > 0


@slow
def test_plan_script_target_path_builds_what_the_fixture_compiled(gpu, capsys):
    """`scripts/plan.py --target` end to end (the planner's own child process, with its
    kernel cache): the same compiled bytes and collectives as the fixture's compile of
    that job."""
    rc, out, err = call(
        "plan",
        "--config",
        TINY_YAML,
        "--target",
        "h100",
        "--devices",
        8,
        "--strategies",
        "full_shard",
        "--json",
        *SMALL,
        "precision=float32",
        capsys=capsys,
    )
    assert rc == 0, err[-3000:]
    r, want = json.loads(out)["strategies"]["full_shard"], gpu["full_shard_f32"]
    assert r["platform"] == want["platform"] == "gpu" and r["mesh"] == want["mesh"]
    assert r["compiled"] == want["compiled"] and r["compiled"]["peak"] > 0
    assert r["collectives_per_step"] == want["collectives_per_step"]
    assert r["collectives_per_step"]["reduce-scatter"]["count"] > 0  # XLA:GPU's, not XLA:CPU's
    # the step-time roofline over that program's traffic (fsdp_jax.app.planner.step_time)
    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.planner import step_time

    cfg = load_config(TINY_YAML, SMALL + ["precision=float32"])
    again = step_time.predict(cfg, "h100", 8, r)
    # every figure equal; `predict_s` is the wall time the prediction took (a timing, not a figure)
    drop = lambda p: {k: v for k, v in p.items() if k != "predict_s"}  # noqa: E731
    assert drop(r["predicted"]) == drop(again) and r["predicted"]["step_s"] > 0
    assert r["predicted"]["predict_s"] >= 0 and again["predict_s"] >= 0


def _exposed(r, op):
    """Bytes per step of parameter-sized `op`s the step waits for: synchronous, or async
    with nothing scheduled between start and done."""
    return sum(
        c["bytes_per_step"] for c in _param_sized(r, op) if not c["async"] or not (c["overlap"] or {}).get("ops")
    )


@slow
def test_two_collectives_in_flight_overlap_the_gathers_xla_012_left_exposed(gpu):
    """The train step compiles for GPUs with several async collectives in flight
    (fsdp_jax.targets.xla_flags.STEP_OPTIONS_GPU). XLA 0.12 keeps one by default, and at Llama-2-7B's
    layer shape its scheduler then runs a backward re-gather synchronously and leaves forward
    gathers with nothing under them; with more, fewer gather bytes are exposed (7B, 32
    layers: none; BENCHMARKS.md). jax 0.10.2 exposes none either way at 7B."""
    now, one = gpu["full_shard_wide"], gpu["full_shard_wide_one_in_flight"]
    assert now["communication"] == one["communication"]  # the same traffic, scheduled differently
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 12):
        assert _exposed(one, "all-gather") > 0
        assert _exposed(now, "all-gather") < _exposed(one, "all-gather") / 2, (
            _exposed(now, "all-gather"),
            _exposed(one, "all-gather"),
        )
    else:
        assert _exposed(now, "all-gather") <= _exposed(one, "all-gather")


@slow
def test_bf16_grad_scatters_are_not_combined_into_one_the_layer_waits_for(gpu):
    """With grads reduced in bf16 (plain dots), XLA combines a layer's weight-grad
    reduce-scatters into one it issues when the layer's backward has nothing left to put under
    it (jax 0.12, 7B: 2.57% of the step's collective bytes). The step's 1 MiB combine threshold
    (fsdp_jax.targets.xla_flags.STEP_OPTIONS_GPU) keeps each weight's scatter behind its own dot."""
    now, combined = gpu["full_shard_wide"], gpu["full_shard_wide_combined"]

    def volume(r):
        return {op: (c["bytes"], c["wire_bytes"]) for op, c in r["communication"].items() if isinstance(c, dict)}

    assert volume(now) == volume(combined)  # the same bytes, in more pieces
    assert now["communication"]["reduce-scatter"]["runs"] > combined["communication"]["reduce-scatter"]["runs"]
    loop = [c for c in _param_sized(now, "reduce-scatter") if c["loop"] is not None]
    assert loop and all(c["dtype"] == "bfloat16" for c in loop)
    assert _exposed(now, "reduce-scatter") <= _exposed(combined, "reduce-scatter")
    if tuple(int(x) for x in jax.__version__.split(".")[:2]) >= (0, 12):
        assert _exposed(combined, "reduce-scatter") > 0, "the reference no longer exposes a scatter"
        assert _exposed(now, "reduce-scatter") < _exposed(combined, "reduce-scatter") / 2


@slow
def test_hybrid_shard_overlaps_every_grad_reduction_in_the_backward_loop(gpu):
    """hybrid_shard with f32 grad reductions ends each layer's backward with two chained
    collectives per weight (reduce-scatter over `fsdp`, all-reduce of the shard over `data`).
    At Llama-2-7B's layer shape, with two collectives in flight, XLA 0.12 ran reduce-scatters
    and a cross-host all-reduce per layer synchronously (jax 0.10: async with nothing under
    them); with the step's compile options none of them is exposed on either jax (7B, 32
    layers, 2 hosts x 4: 9.95% of the step's collective bytes -> 0%; BENCHMARKS.md)."""
    now, two = gpu["hybrid_wide"], gpu["hybrid_wide_two_in_flight"]
    assert now["mesh"] == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert now["communication"] == two["communication"]  # the same traffic, scheduled differently

    def exposed(r):
        return {
            (c["name"], c["op"], c["bytes"])
            for op in ("reduce-scatter", "all-reduce")
            for c in _param_sized(r, op)
            if c["phase"] == "backward" and c["loop"] is not None and c["bytes"] >= 1 << 20
            if not c["async"] or not (c["overlap"] or {}).get("ops")
        }

    scatters = [c for c in _param_sized(now, "reduce-scatter") if c["loop"] is not None]
    assert scatters and all(c["dtype"] == "float32" for c in scatters)
    assert exposed(two), "the two-in-flight compile no longer exposes a grad reduction: the test lost its reference"
    assert not exposed(now), sorted(exposed(now))


@pytest.mark.parametrize(
    "platform, shards, xla_flags, want",
    [
        ("gpu", True, "", {ONE_IN_FLIGHT: 8, COMBINE: 1 << 20}),
        ("gpu", True, f"--xla_dump_to=/x --{ONE_IN_FLIGHT}=3", {COMBINE: 1 << 20}),  # the user's own value wins
        ("gpu", True, f"--{ONE_IN_FLIGHT}=3 --{COMBINE}=0", None),
        ("gpu", False, "", None),  # no_shard / shard_opt: no per-layer gathers to overlap
        ("cpu", True, "", None),
        ("tpu", True, "", None),
    ],
)
def test_step_compiler_options_only_for_gpu_steps_that_gather(platform, shards, xla_flags, want):
    from types import SimpleNamespace

    from fsdp_jax.targets.xla_flags import step_compiler_options

    devs = [SimpleNamespace(platform=platform)] * 8
    assert step_compiler_options(devs, shards, environ={"XLA_FLAGS": xla_flags}) == want


@slow
def test_full_shard_f32_compute_gathers_f32(gpu):
    gathers = _param_sized(gpu["full_shard_f32"], "all-gather")
    assert gathers and all(c["dtype"] == "float32" for c in gathers)
    assert all(c["dtype"] == "float32" for c in _colls(gpu["full_shard_f32"], "reduce-scatter"))


@slow
def test_shard_grad_op_gathers_each_layer_once_and_keeps_it_for_the_backward(gpu):
    """ZeRO-2 (fsdp_jax.train.layer_gather, keep=True): the forward loop gathers each layer, the
    backward uses the kept copy (no second gather), and the unstacked params are
    gathered once outside the loop: every sharded param crosses the wire once."""
    r = gpu["shard_grad_op"]
    gathers = _param_sized(r, "all-gather")
    assert gathers and all(c["phase"] == "forward" for c in gathers), r["schedule"]
    assert all(c["runs"] == 2 and "while" in c["loop"] for c in gathers if c["loop"])
    assert all(c["dtype"] == "bfloat16" and c["async"] for c in gathers)
    assert sum(c["bytes_per_step"] for c in gathers) == sum(
        x["total_bytes"] // 2 for x in r["rows"] if any(a in x["spec"] for a in ("fsdp", "data"))
    )


@slow
def test_shard_grad_op_reduce_scatters_grads(gpu):
    """Each layer's grads are reduce-scattered into their 1/8 shards inside the backward
    loop (a gather of the whole tree before the loop made XLA:GPU all-reduce full-size
    grads there and keep a slice)."""
    r = gpu["shard_grad_op"]
    assert not [c for c in _param_sized(r, "all-reduce") if c["phase"] == "backward"]
    in_loop = [c for c in _colls(r, "reduce-scatter", phase="backward") if c["loop"]]
    layer = sum(c["bytes"] for c in _param_sized(r, "all-gather") if c["loop"])
    assert in_loop and sum(c["bytes"] for c in in_loop) * 8 == layer, r["schedule"]
    assert not any("reduce-scatter was expected" in w for w in r["warnings"])


@slow
def test_no_shard_all_reduces_grads_and_gathers_nothing(gpu):
    r = gpu["no_shard"]
    assert not _colls(r, "all-gather") and not _colls(r, "reduce-scatter")
    grads = [c for c in _param_sized(r, "all-reduce") if c["phase"] == "backward"]
    assert grads and all(c["group_size"] == 8 for c in grads)


@slow
def test_shard_opt_all_reduces_grads_and_shards_the_optimizer_state(gpu):
    r, ddp = gpu["shard_opt"], gpu["no_shard"]
    assert _param_sized(r, "all-reduce") and not _colls(r, "reduce-scatter", phase="backward")
    # updated params leave the sharded update through an all-gather (outside any loop)
    assert any(c["loop"] is None for c in _param_sized(r, "all-gather"))
    assert r["analytic"]["optimizer"] * 7 < ddp["analytic"]["optimizer"]
    assert r["compiled"]["argument"] < ddp["compiled"]["argument"]


@slow
def test_hybrid_shard_scatters_within_a_host_and_reduces_across_hosts(gpu):
    r = gpu["hybrid_shard"]
    assert r["mesh"] == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    scatters = _colls(r, "reduce-scatter", phase="backward")
    assert scatters and all(c["group_size"] == 4 and c["crosses_hosts"] is False for c in scatters)
    across = [c for c in _param_sized(r, "all-reduce") if c["crosses_hosts"]]
    assert across and all(c["group_size"] == 2 for c in across)
    gathers = _param_sized(r, "all-gather")
    assert gathers and all(c["crosses_hosts"] is False for c in gathers)
    assert not any("reduce-scatter was expected" in w for w in r["warnings"])


@slow
def test_communication_volume_matches_zero3_zero2_and_ddp_theory(gpu):
    """Bytes each device sends per step (ring algorithms, `hlo.wire_bytes`) against
    theory, with P = the sharded params in bf16 and N = 8: ZeRO-3 gathers the stacked
    layers twice (forward, backward) and the unstacked embedding and head once, and
    reduce-scatters every grad once: (2 stacked + unstacked + P) (N-1)/N, about 3P for a
    deep model; DDP all-reduces every grad: 2P (N-1)/N."""
    fs, ddp = gpu["full_shard"], gpu["no_shard"]
    rows = fs["rows"]
    sharded = [x for x in rows if "fsdp" in x["spec"]]
    stacked = sum(x["total_bytes"] // 2 for x in sharded if len(x["shape"]) >= 3)
    p = sum(x["total_bytes"] // 2 for x in sharded)
    com = fs["communication"]
    assert com["all-gather"]["wire_bytes"] == pytest.approx((2 * stacked + (p - stacked)) * 7 / 8, rel=0.01)
    assert com["reduce-scatter"]["wire_bytes"] == pytest.approx(p * 7 / 8, rel=0.01)
    # ZeRO-2 gathers every sharded param once and reduce-scatters every grad once: 2P (N-1)/N
    z2 = gpu["shard_grad_op"]["communication"]
    assert z2["all-gather"]["wire_bytes"] == pytest.approx(p * 7 / 8, rel=0.01)
    assert z2["reduce-scatter"]["wire_bytes"] == pytest.approx(p * 7 / 8, rel=0.01)
    every = sum(x["total_bytes"] // 2 for x in ddp["rows"])
    assert ddp["communication"]["total_wire_bytes"] == pytest.approx(2 * every * 7 / 8, rel=0.02)
    assert set(ddp["communication"]) == {"all-reduce", "total_wire_bytes"}


# ----------------------------------------------------------------------------- memory


@slow
def test_full_shard_holds_one_eighth_of_no_shard(gpu):
    """Exactly 1/8, once the batch, the replicated small leaves (norm scales: params and
    both Adam moments) and the scalar counters are taken out."""
    fs, ddp = gpu["full_shard"], gpu["no_shard"]
    replicated = 3 * sum(x["bytes_per_device"] for x in fs["rows"] if "fsdp" not in x["spec"])
    state_ddp = ddp["compiled"]["argument"] - ddp["analytic"]["batch"]
    scalars = state_ddp - 3 * sum(x["total_bytes"] for x in ddp["rows"])  # step, Adam count, ...
    assert 0 < scalars < 64
    state_fs = fs["compiled"]["argument"] - fs["analytic"]["batch"]
    assert 8 * (state_fs - replicated - scalars) == state_ddp - replicated - scalars


@slow
def test_offload_on_a_gpu_target_is_the_device_compile_plus_the_host_by_formula(gpu):
    """Compile-only GPU devices have no pinned_host memory kind: `offload: optimizer` plans the
    device side from the target compile of the same step without offload, minus the optimizer
    state that rests on the host, plus one leaf's state streamed back for the update; the
    host side is the optimizer state's shard bytes (fsdp_jax.app.planner.target_offload)."""
    r, plain = gpu["full_shard_offload_opt"], gpu["full_shard"]
    a, c = r["analytic"], r["compiled"]
    assert r["offload"] == "optimizer" and r["platform"] == "gpu"
    assert r["warnings"][0].startswith("offload optimizer on a GPU target: compile-only NVIDIA H100")
    assert c["peak"] == plain["compiled"]["peak"] and c["argument"] == plain["compiled"]["argument"]
    # the host holds Adam's mu and nu (the counters are 4-byte scalars)
    assert 0 <= plain["analytic"]["optimizer"] - a["host"] < 64 and a["host_per_host"] == 8 * a["host"]
    assert c["host_argument"] == a["host"] and c["device_argument"] == c["argument"] - a["host"]
    streamed = c["device_peak"] - (c["peak"] - a["host"])  # one leaf's mu + nu, back for the update
    largest = max(x["bytes_per_device"] for x in plain["rows"])
    assert abs(streamed - 2 * largest) <= 8, (streamed, largest)  # the counters' share of the ratio
    assert abs(c["device_peak"] / a["device_total"] - 1) < PEAK_TOLERANCE


@slow
def test_nonfinite_guard_costs_no_state_copy(gpu):
    """The guard (skip_nonfinite, on by default) must not make XLA:GPU write the new state
    into fresh buffers: its temp stays that of the unguarded step (a lax.cond over the
    update added a whole state copy: 1.72 MB vs 1.08 MB temp here)."""
    on, off = gpu["no_shard"]["compiled"], gpu["no_shard_unguarded"]["compiled"]
    batch = gpu["no_shard"]["analytic"]["batch"]
    assert on["alias"] == off["alias"] == on["argument"] - batch  # every state buffer donated
    assert abs(on["temp"] - off["temp"]) < 0.05 * on["argument"], (on, off)


@slow
def test_planner_analytic_is_within_tolerance_of_the_gpu_compile(gpu):
    for name in ("full_shard", "shard_grad_op", "no_shard", "hybrid_shard"):
        r = gpu[name]
        a, c = r["analytic"], r["compiled"]
        assert c["argument"] == a["params"] + a["optimizer"] + a["batch"], name
        assert abs(c["peak"] / a["total"] - 1) < PEAK_TOLERANCE, (name, c["peak"], a["total"])


# ----------------------------------------------------------------------------- HLO analysis units

_HLO = """HloModule m, is_scheduled=true

%body (p: (s32[], bf16[8,16])) -> (s32[], bf16[8,16]) {
  %p = (s32[], bf16[8,16]{1,0}) parameter(0)
  %x = bf16[8,16]{1,0} get-tuple-element(%p), index=1
  %ags = ((bf16[8,16]{1,0}, bf16[2,16]{1,0}), (bf16[64,16]{1,0}, bf16[16,16]{1,0})) all-gather-start(%x, %x), replica_groups=[2,4]<=[8], dimensions={0}, metadata={op_name="jit(step)/transpose(jvp())/while/body/dot"}
  %f1 = bf16[8,16]{1,0} fusion(%x), kind=kCustom, calls=%gemm_fusion_dot.1
  %f2 = bf16[8,16]{1,0} fusion(%f1), kind=kLoop, calls=%fused_add
  %agd = (bf16[64,16]{1,0}, bf16[16,16]{1,0}) all-gather-done(%ags)
  %ars = f32[1024]{0} all-reduce-start(%y), replica_groups=mesh['axis_0'=4,'axis_1'=2], device_ids=([2,4]T(1,0)) {'axis_1'}, to_apply=%add
  %ard = f32[1024]{0} all-reduce-done(%ars)
  ROOT %t = (s32[], bf16[8,16]{1,0}) tuple(%i, %x)
}

%cond (p: (s32[], bf16[8,16])) -> pred[] {
  ROOT %c = pred[] constant(true)
}

ENTRY %main (a: bf16[8,16]) -> bf16[8,16] {
  %a = bf16[8,16]{1,0} parameter(0)
  %w = (s32[], bf16[8,16]{1,0}) while(%t0), condition=%cond, body=%body, metadata={op_name="jit(step)/transpose(jvp())/while"}, backend_config={"known_trip_count":{"n":"3"}}
  %ar = f32[4096]{0} all-reduce(%a), replica_groups={{0,1,2,3},{4,5,6,7}}, to_apply=%add
  ROOT %r = bf16[8,16]{1,0} get-tuple-element(%w), index=1
}
"""


@pytest.mark.parametrize(
    "start_type",
    [
        "f32[1024]{0}",  # XLA 0.10: the result
        "((f32[1024]{0}), f32[1024]{0})",
    ],
)  # 0.12: ((operands), result)
def test_async_all_reduce_counts_its_result_once_in_either_spelling(start_type):
    text = _HLO.replace("%ars = f32[1024]{0} all-reduce-start", f"%ars = {start_type} all-reduce-start")
    ar = {c["name"]: c for c in hlo.collective_schedule(text)}["ars"]
    assert (ar["bytes"], ar["elements"], ar["runs"], ar["bytes_per_step"]) == (4096, 1, 3, 3 * 4096)


def test_schedule_reads_async_pairs_overlap_groups_and_hosts():
    sched = {c["name"]: c for c in hlo.collective_schedule(_HLO, hosts=[0] * 4 + [1] * 4)}
    ag = sched["ags"]
    assert (ag["op"], ag["dtype"], ag["bytes"], ag["elements"], ag["runs"]) == (
        "all-gather",
        "bfloat16",
        (64 + 16) * 16 * 2,
        2,
        3,
    )
    assert ag["phase"] == "backward" and ag["loop"] == "jit(step)/transpose(jvp())/while"
    assert ag["async"] and ag["overlap"] == {"ops": 2, "gemms": 1, "names": ["f1", "f2"]}
    assert (ag["group_size"], ag["crosses_hosts"]) == (4, False)
    ar = sched["ars"]  # groups over axis_1 of ids [2,4]T(1,0) reshaped (4, 2): {0,4}, {1,5}, ...
    assert (ar["group_size"], ar["crosses_hosts"], ar["overlap"]["ops"]) == (2, True, 0)
    sync = sched["ar"]
    assert not sync["async"] and sync["loop"] is None and sync["phase"] == "other"
    assert (sync["group_size"], sync["crosses_hosts"], sync["bytes"]) == (4, False, 16384)
    assert hlo.schedule_totals(list(sched.values()))["all-gather"] == {"count": 3, "bytes": 3 * 2560}


@pytest.mark.parametrize(
    "text, groups",
    [
        ("replica_groups={{0,2},{1,3}}, x", [[0, 2], [1, 3]]),
        ("replica_groups=[2,2]<=[4], x", [[0, 1], [2, 3]]),
        ("replica_groups=[2,2]<=[2,2]T(1,0), x", [[0, 2], [1, 3]]),
        ("replica_groups=mesh['a'=2,'b'=2] {'a'}, x", [[0, 2], [1, 3]]),
        ("replica_groups={}, x", [[0, 1, 2, 3]]),
    ],
)
def test_replica_group_spellings(text, groups):
    assert hlo.replica_groups(text, 4) == groups


def test_warnings_name_what_to_fix():
    base = {
        "name": "x",
        "runs": 2,
        "loop": "jit(step)/transpose(jvp())/while",
        "phase": "backward",
        "async": True,
        "pipelined": False,
        "overlap": {"ops": 3, "gemms": 1, "names": []},
        "group_size": 8,
        "crosses_hosts": False,
        "bytes": 1 << 22,
        "bytes_per_step": 2 << 22,
        "dtype": "bfloat16",
    }
    sched = [
        dict(base, op="all-reduce"),
        dict(base, op="all-gather", dtype="float32", name="g"),
        dict(base, op="reduce-scatter", overlap={"ops": 0, "gemms": 0, "names": []}),
        dict(base, op="all-reduce", group_size=2, name="dcn"),
    ]
    w = schedule_warnings(sched, compute_dtype="bfloat16", shards_grads=True, replicated_group=2)
    assert len(w) == 3
    assert w[0].startswith("gradient all-reduce where a reduce-scatter was expected: 1 all-reduce (x; ")
    assert w[1].startswith("float32 all-gather under bfloat16 compute: 1 all-gather (g; ")
    assert w[2].startswith("reduce-scatter with no compute overlapping it")
    assert "inside loop jit(step)/transpose(jvp())/while" in w[0] and "8.39 MB per step" in w[0]
    # the optimizer update's f32 gather of updated params (ZeRO-1) is not a compute gather
    assert not schedule_warnings([dict(sched[1], phase="other", loop=None)], compute_dtype="bfloat16")
    assert not schedule_warnings(sched[:1], compute_dtype="bfloat16", shards_grads=False)
    hoisted = [dict(base, op="all-gather", loop=None, bytes=50 << 20)]
    assert (
        "hoisted out of the layer loop"
        in schedule_warnings(hoisted + sched[:1], gathers_per_layer=True, layer_gather_bytes=1 << 20)[-1]
    )


def test_involuntary_rematerialization_names_the_tensor():
    log = (
        "E0000 spmd_partitioner.cc:613] [spmd] Involuntary full rematerialization. The compiler was "
        "not able to go from sharding {devices=[8,1]<=[8]} to {devices=[1,8]<=[8]} without doing a "
        "full rematerialization of the tensor for HLO operation: %reshape.7 = bf16[64,128]{1,0} "
        'reshape(%p.1), sharding={devices=[8,1]<=[8]}, metadata={op_name="jit(step)/reshape"}. You '
        "probably want to enrich the sharding annotations to prevent this from happening."
    )
    [r] = involuntary_rematerializations("other line\n" + log)
    assert r == {
        "tensor": "reshape.7",
        "shape": "bf16[64,128]{1,0}",
        "opcode": "reshape",
        "from": "{devices=[8,1]<=[8]}",
        "to": "{devices=[1,8]<=[8]}",
        "op_name": "jit(step)/reshape",
    }


@pytest.mark.parametrize(
    "type_str, op, want",
    [
        # one operand: (operand, result); several: ((operands), (results)); a done: the result
        ("(bf16[512,4096]{1,0}, bf16[4096,4096]{1,0})", "all-gather", [("bf16", 4096 * 4096)]),
        ("(bf16[4096,4096]{1,0}, bf16[512,4096]{1,0})", "reduce-scatter", [("bf16", 512 * 4096)]),
        (
            "((bf16[8,16]{1,0}, bf16[2,16]{1,0}), (bf16[64,16]{1,0}, bf16[16,16]{1,0}))",
            "all-gather",
            [("bf16", 64 * 16), ("bf16", 16 * 16)],
        ),
    ],
)
def test_async_start_counts_its_result_only(type_str, op, want):
    """A 7B layer's single-operand all-gather-start was counted as operand + result (9/8 of
    the gathered bytes at N=8) before."""
    assert hlo.result_shapes(type_str, op, is_start=True) == want
