"""TPU targets: the target table and topologies, bad input, libtpu in its private folder, and
deviceless XLA:TPU compiles of the trainer's step (libtpu is installed by README's set-up
command: `python -m fsdp_jax.targets install tpu`, run by .ci/run)."""

import json
import os
import subprocess
import sys

import pytest

from fsdp_jax import targets
from fsdp_jax.app.planner import over_memory
from helpers import ROOT, TINY_MODEL_OVERRIDES, call, one_line

TINY_YAML = "configs/tiny.yaml"


@pytest.mark.parametrize("kwargs, want", [
    ({"name": "v5p", "devices": 8}, ("v5p", 1, 8, "2x2x2")),
    ({"name": "v5p-64"}, ("v5p", 1, 32, "2x4x4")),          # v5p types count TensorCores: 32 chips
    ({"name": "v6e-256"}, ("v6e", 1, 256, "16x16")),        # v6e types count chips
    ({"name": "v5e", "devices": 16, "slices": 2}, ("v5e", 2, 8, "2x4")),
    ({"name": "v5p", "topology": "4x4x4", "slices": 2}, ("v5p", 2, 64, "4x4x4")),
    ({"name": "v4", "devices": 16}, ("v4", 1, 16, "2x2x2")),  # libtpu makes 2 devices of a v4 chip
    ({"name": "v5e", "devices": 1}, ("v5e", 1, 1, "1x1")),
])
def test_tpu_target_requests(kwargs, want):
    t = targets.make_target(**kwargs)
    assert (t.name, t.hosts, t.gpus_per_host, t.topology_name) == want
    assert t.platform == "tpu" and t.devices == want[1] * want[2]
    assert targets.Target(**t.as_dict()) == t  # what the planner's child receives


@pytest.mark.parametrize("kwargs, needle", [
    ({"name": "v9", "devices": 8}, "--target: unknown TPU generation 'v9'; known: v4, v5e, v5p, v6e"),
    ({"name": "v5p", "devices": 12}, "--devices: 12 chips per slice is not a v5p slice size"),
    ({"name": "v5e", "devices": 512}, "a power of two up to 256"),
    ({"name": "v5p", "devices": 8, "slices": 3}, "--slices: 8 devices do not divide into 3 slices"),
    ({"name": "v5p", "topology": "2x2"}, "--topology: '2x2' is not a 3-D v5p topology"),
    ({"name": "v6e", "topology": "4x0"}, "--topology: '4x0' is not a 2-D v6e topology"),
    ({"name": "v5e", "topology": "32x32"}, "has 1024 chips; a v5e slice has at most 256"),
    ({"name": "v5p", "topology": "2x2x2", "devices": 16}, "--devices: 16 is not 1 slice(s) x 8 devices"),
    ({"name": "v5p-63"}, "count TensorCores, 2 per chip; 63 is odd"),
    ({"name": "v5p", "devices": 8, "hosts": 2}, "--hosts: a TPU target's hosts come from its topology"),
    ({"name": "h100", "devices": 8, "slices": 2}, "--slices: only for TPU targets"),
    ({"name": "h100", "devices": 8, "topology": "2x2"}, "--topology: only for TPU targets"),
    ({"name": "v5p", "devices": 0}, "--devices: 0 must be a positive integer"),
    ({"name": "v5p"}, "--devices: give the number of TPU chips"),
])
def test_bad_tpu_requests_name_the_flag(kwargs, needle):
    with pytest.raises(targets.TargetError) as e:
        targets.make_target(**kwargs)
    assert needle in str(e.value)


def test_device_memory_is_what_xla_tpu_enforces():
    gib = 2**30
    assert targets.device_memory("v5p") == int(95.74 * gib)
    assert targets.device_memory("v6e-256") == int(31.25 * gib)
    assert targets.device_memory("v5e") == int(15.75 * gib)
    assert targets.device_memory("v4") == int(15.25 * gib)  # per core-device: 2 per chip
    assert set(targets.target_names("tpu")) == {"v4", "v5e", "v5p", "v6e"}
    assert set(targets.target_names()) == set(targets.target_names("gpu")) | set(targets.target_names("tpu"))


def test_compiler_refusal_is_read_as_does_not_fit():
    msg = ("RESOURCE_EXHAUSTED: Ran out of memory on HBM, the total memory required for HLO "
           "temporaries (104.34G) exceeds available HBM (95.74G).")
    got = over_memory(RuntimeError(msg))
    assert got == {"temp": int(104.34 * 2**30), "available": int(95.74 * 2**30)}
    assert over_memory(RuntimeError("INVALID_ARGUMENT: something else")) is None


@pytest.mark.parametrize("args, words", [
    (["--target", "v9", "--devices", 8], ["--target", "v9"]),
    (["--target", "v5p", "--devices", 12], ["--devices", "12"]),
    (["--target", "v5p", "--devices", 8, "--slices", 3], ["--slices"]),
    (["--target", "v5p", "--topology", "2x2"], ["--topology"]),
    (["--target", "v5p", "--devices", 8, "--hosts", 2], ["--hosts"]),
    (["--target", "h100", "--devices", 8, "--slices", 2], ["--slices"]),
    (["--devices", 8, "--slices", 2], ["--slices", "needs --target"]),
    (["--devices", 8, "--topology", "2x2x2"], ["--topology", "needs --target"]),
    (["--target", "v5p"], ["--devices"]),
    ([], ["--devices"]),
])
@pytest.mark.parametrize("script", ["plan", "inspect_sharding"])
def test_scripts_refuse_bad_tpu_flags_in_one_line(script, args, words, capsys, tmp_path):
    rc, out, err = call(script, "--config", TINY_YAML, *args, capsys=capsys,
                        env={"FSDP_JAX_LIBTPU_DIR": str(tmp_path)})
    one_line(rc, err, *words)
    assert out == ""


def test_missing_libtpu_names_the_install_command(capsys, tmp_path):
    rc, out, err = call("plan", "--config", TINY_YAML, "--target", "v5p", "--devices", 8, capsys=capsys,
                        env={"FSDP_JAX_LIBTPU_DIR": str(tmp_path / "none")})
    one_line(rc, err, "libtpu", "python -m fsdp_jax.targets install tpu")


def test_cpu_processes_never_see_libtpu():
    """libtpu lives outside site-packages: a normal process neither finds it nor logs about TPUs."""
    code = "import importlib.util, jax; jax.devices(); print(importlib.util.find_spec('libtpu') is None)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=dict(os.environ, JAX_PLATFORMS=""), cwd=ROOT)
    assert proc.stdout.strip() == "True", proc.stderr[-2000:]
    assert "TPU" not in proc.stderr, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- compiles


def _libtpu():
    assert targets.plugin_installed(kind="tpu"), (
        f"libtpu is not installed in {targets.plugin_dir(kind='tpu')}: run `python -m fsdp_jax.targets "
        "install tpu` (README's set-up command does)")


@pytest.mark.slow
def test_tiny_compiles_for_two_v5p_slices(capsys):
    """scripts/plan.py --target v5p --slices 2: XLA:TPU's own program (compile-only devices
    over 2 slices); hybrid_shard puts `data` across the slices and `fsdp` within one, and
    the analytic argument bytes equal the compiled ones up to XLA:TPU's layout padding:
    weights here are multiples of its (8, 128) tiles, while the per-device token batch (2, 33)
    and the stacked norm scales (2, 256) fill whole tiles (under 32 KiB in all; at 7B
    the two agree to 0.00%, docs/planning.md)."""
    _libtpu()
    tiny = [o for o in TINY_MODEL_OVERRIDES if not o.startswith(("model.d_model", "model.ffn_dim",
                                                                  "model.n_heads", "model.n_kv_heads"))]
    rc, out, err = call("plan", "--config", TINY_YAML, "--target", "v5p", "--devices", 8, "--slices", 2,
                        "--strategies", "full_shard,hybrid_shard", "--json", *tiny, "model.d_model=256",
                        "model.n_heads=2", "model.n_kv_heads=2", "model.ffn_dim=512", capsys=capsys)
    assert rc == 0, err[-3000:]
    doc = json.loads(out)
    assert doc["target"] == {"name": "v5p", "hosts": 2, "gpus_per_host": 4, "topology_name": "2x2x1"}
    assert doc["device_memory"] == targets.device_memory("v5p")
    fs, hs = doc["strategies"]["full_shard"], doc["strategies"]["hybrid_shard"]
    assert fs["platform"] == hs["platform"] == "tpu"
    assert fs["mesh"] == {"data": 1, "fsdp": 8, "tensor": 1}
    assert hs["mesh"] == {"data": 2, "fsdp": 4, "tensor": 1}
    for r in (fs, hs):
        a = r["analytic"]
        excess = r["compiled"]["argument"] - (a["params"] + a["optimizer"] + a["batch"])
        assert r["compiled"]["peak"] > 0 and 0 <= excess < 32 * 1024, excess
        assert r["collectives_per_step"]  # XLA:TPU's collectives, read by the same inspector
    assert hs["compiled"]["argument"] > fs["compiled"]["argument"]  # replicated over the 2 slices
