"""8 CPU devices for every test, a persistent compilation cache, LLVM at -O0, and the
shared corpus fixture."""

import os
import pathlib

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
# The tests check sharding, HLO, bytes and numerics, not the speed of XLA:CPU's machine
# code, and most of a CPU compile is LLVM optimising it: at -O0 the tiny Llama's init and
# step compile 2-3x faster with the same collectives and memory_analysis() bytes, and a
# bf16-compute loss within 7e-6 relative (FMA contraction and summation order differ;
# every parity test compares runs compiled alike). benchmarks/compile_opt_level.py
# measures it. Child processes inherit the flag; GPU-target compiles are unaffected (their
# collectives and bytes were compared equal). Set before the CPU backend starts.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]).strip()
# The suite is 8 CPU devices on any machine: on a GPU host the xdist workers would
# otherwise each claim the GPU (scripts/gpu_check.py is the GPU check).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
os.environ.setdefault("FSDP_JAX_CACHE_DIR", str(ROOT / ".jax_cache"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small deterministic byte corpus (helpers.synthetic_corpus), prepared once per session."""
    from helpers import synthetic_corpus
    return synthetic_corpus(tmp_path_factory.mktemp("corpus"))
