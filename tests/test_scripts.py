"""Command-line contracts of the benchmark and GPU-check scripts (CPU-checkable parts)."""

import contextlib
import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import pytest

from fsdp_jax.app.devices import without_compilation_cache
from helpers import call

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.n_layers=2", "model.d_model=64", "model.ffn_dim=128", "model.max_seq_len=32", "data.seq_len=32"]


def run(script, *args, timeout=300):
    env = dict(os.environ, FSDP_JAX_CPU_DEVICES="8")
    return subprocess.run(
        [sys.executable, str(ROOT / "scripts" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        cwd=ROOT,
        env=env,
    )


@pytest.mark.slow
def test_benchmark_json_document(capsys):
    rc, out, err = call(
        "benchmark",
        "--config",
        "configs/tiny.yaml",
        "--strategies",
        "zero3",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--json",
        "--baselines",
        "--sweep",
        "devices=8",
        *SMALL,
        capsys=capsys,
    )
    assert rc == 0, err[-2000:]
    doc = json.loads(out)
    assert doc["devices"] == 8 and doc["backend"] == "cpu" and doc["config"] == "configs/tiny.yaml"
    names = [x["strategy"] for x in doc["results"]]
    assert names == ["full_shard", "single_device", "plain_dp"]
    for x in doc["results"]:
        for key in ("compile_s", "step_s_median", "step_s_min", "step_s_max", "tokens_per_s", "mfu", "peak_bytes"):
            assert key in x
        assert x["step_s_min"] <= x["step_s_median"] <= x["step_s_max"]
        assert x["tokens_per_s"] > 0 and x["peak_bytes"] > 0 and x["mfu"] is None  # CPU: no peak FLOP/s
    assert doc["results"][1]["devices"] == 1
    assert jax.config.jax_enable_compilation_cache  # the benchmark turned the cache off for itself only


@contextlib.contextmanager
def cache_events():
    """The last word of each `/jax/compilation_cache/...` event JAX records inside (`cache_hits`, ...)."""
    seen = []

    def listen(event, **_):
        if event.startswith("/jax/compilation_cache/"):
            seen.append(event.rsplit("/", 1)[-1])

    jax.monitoring.register_event_listener(listen)
    try:
        yield seen
    finally:
        jax.monitoring.unregister_event_listener(listen)


def test_without_the_compilation_cache_a_program_it_holds_compiles_cold_and_after_it_hits(tmp_path):
    """JAX reads `jax_enable_compilation_cache` at a process's first compile only (this worker's
    was long ago): inside `without_compilation_cache()` a program the persistent cache holds is
    compiled again, its HLO dumped as asked (the benchmark's cold compiles, test_fp8_hlo's dumps);
    after it the cache answers again."""

    shape = jax.ShapeDtypeStruct((5, 3), jnp.float32)

    def compile_(dump=None):  # a new function each time: no in-memory hit, the same program
        opts = {"xla_dump_to": str(tmp_path / dump)} if dump else None
        with cache_events() as seen:
            jax.jit(lambda x: jnp.tanh(x) * 3.0 + 1.0).lower(shape).compile(compiler_options=opts)
        return seen

    def compiled(dump):  # XLA dumps the module before its passes only when it compiles it
        return sorted(p.name for p in (tmp_path / dump).glob("*before_optimizations*"))

    assert jax.config.jax_compilation_cache_dir and jax.config.jax_enable_compilation_cache  # tests/conftest.py
    compile_()  # the cache holds it now, if it did not already
    seen = compile_("warm")
    assert "cache_hits" in seen and not compiled("warm"), (seen, compiled("warm"))
    with without_compilation_cache():
        assert not jax.config.jax_enable_compilation_cache
        seen = compile_("cold")
    assert "cache_hits" not in seen and compiled("cold"), (seen, compiled("cold"))
    assert jax.config.jax_enable_compilation_cache
    seen = compile_("after")
    assert "cache_hits" in seen and not compiled("after"), (seen, compiled("after"))


def test_benchmark_entry_point_bad_input_exits_2():
    """`python scripts/benchmark.py`'s own entry point, once: a missing flag is one line, exit 2."""
    r = run("benchmark.py", "--strategies", "zero3")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    lines = [l for l in r.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "--config" in lines[0], r.stderr


@pytest.mark.parametrize(
    "args, words",
    [
        (["--device-memory-gb", "-3"], "--device-memory-gb"),
        (["--device-memory-gb", "0"], "--device-memory-gb"),
        (["--device-memory-gb", "nan"], "--device-memory-gb"),
        (["--hosts", "0"], "--hosts"),
        (["--per-host", "two"], "--per-host"),
        (["--min-bytes", "-1"], "--min-bytes"),
        (["--variant", "now=[1]"], "--variant"),
        (["--variant", "now"], "--variant"),
    ],
)
def test_exposed_collectives_benchmark_bad_flags_exit_2_with_one_line(args, words, capsys):
    """benchmarks/exposed_collectives.py refuses a bad flag before compiling anything."""
    from helpers import _load

    try:
        rc = _load("benchmarks", "exposed_collectives").main(["--config", "configs/llama2_7b.yaml", *args])
    except SystemExit as e:
        rc = e.code
    out, err = capsys.readouterr()
    lines = [l for l in err.splitlines() if l.strip()]
    assert rc == 2 and out == "" and len(lines) == 1, err
    assert lines[0].startswith("error: ") and words in lines[0], err


def test_gpu_flags_are_appended_not_overriding():
    from fsdp_jax.targets.xla_flags import GPU_FSDP_FLAGS, apply_gpu_fsdp_flags

    env = {"XLA_FLAGS": "--xla_gpu_enable_latency_hiding_scheduler=false"}
    out = apply_gpu_fsdp_flags(env)
    assert "--xla_gpu_enable_latency_hiding_scheduler=false" in out
    assert "--xla_gpu_enable_latency_hiding_scheduler=true" not in out
    assert all(f in out for f in GPU_FSDP_FLAGS[1:])


def test_xla_gpu_flags_config_option():
    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.errors import ConfigError

    assert load_config(ROOT / "configs" / "tiny.yaml").xla_gpu_flags == "none"
    assert load_config(ROOT / "configs" / "tiny.yaml", ["xla_gpu_flags=fsdp"]).xla_gpu_flags == "fsdp"
    try:
        load_config(ROOT / "configs" / "tiny.yaml", ["xla_gpu_flags=yes"])
    except ConfigError as e:
        assert "xla_gpu_flags" in str(e) and "none, fsdp" in str(e)
    else:
        raise AssertionError("xla_gpu_flags=yes was accepted")


@pytest.mark.slow
def test_gpu_check_throughput_path_runs_on_cpu(tmp_path, capsys):
    """The GPU script's throughput check, with XLA attention so the CPU can run it (in this
    process: its 8 CPU devices)."""
    rc, out, err = call(
        "gpu_check",
        "--config",
        "configs/tiny.yaml",
        "--only",
        "throughput",
        "--steps",
        "1",
        "--json",
        tmp_path / "r.json",
        "model.attention=xla",
        *SMALL,
        capsys=capsys,
    )
    assert rc == 0, out[-2000:] + err[-2000:]
    res = json.loads((tmp_path / "r.json").read_text())["throughput"]
    assert res["devices"] == 8 and res["global_batch"] == 64 and res["tokens_per_s"] > 0
    assert "| throughput" in out and "precision" not in out.split("| check")[-1]


@pytest.mark.slow
def test_gpu_check_entry_point_bad_input_exits_2():
    """`python scripts/gpu_check.py`'s own entry point, once: bad input is one line, exit 2."""
    r = run("gpu_check.py", "--only", "speed")
    assert r.returncode == 2 and r.stdout == "", r.stderr
    assert [l for l in r.stderr.splitlines() if l.strip()] == [
        "error: --only 'speed' / --steps 10: checks are throughput, precision, collectives, cudnn_packed, "
        "ring_cudnn, tokamax_moe, lora, offload; steps >= 1"
    ]
