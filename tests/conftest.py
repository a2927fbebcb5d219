"""8 CPU devices for every test, a persistent compilation cache, LLVM at -O0, and the
shared corpus fixture."""

import json
import os
import pathlib
import subprocess
import sys

import jax
import jaxlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = ROOT / ".jax_cache"
# XLA:CPU's older loop emitters compile the tiny Llama's step 2.8x faster than its MLIR fusion
# emitters, with the same collectives, argument bytes and loss (temp +256 B; two scatter-adds
# become while loops); benchmarks/compile_opt_level.py measures both. jaxlib 0.12.0.1 no
# longer registers the flag, and XLA aborts on an unknown XLA_FLAGS entry, so a child process
# tries it once per jaxlib version (the answer is kept next to the compilation cache).
FAST_CODEGEN = "--xla_cpu_use_fusion_emitters=false"


def _xla_knows(flag: str) -> bool:
    memo = CACHE / f"xla-flag-{jaxlib.__version__}-{flag.strip('-').split('=')[0]}.json"
    try:
        return json.loads(memo.read_text())
    except (OSError, ValueError):
        pass
    env = dict(os.environ, XLA_FLAGS=flag, JAX_PLATFORMS="cpu")
    known = subprocess.run([sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
                           env=env, capture_output=True).returncode == 0
    try:  # best effort: a read-only checkout probes again next time
        CACHE.mkdir(exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(memo)
    except OSError:
        pass
    return known

# The tests check sharding, HLO, bytes and numerics, not the speed of XLA:CPU's machine
# code, and most of a CPU compile is LLVM optimising it: at -O0 the tiny Llama's init and
# step compile 2-3x faster with the same collectives and memory_analysis() bytes, and a
# bf16-compute loss within 7e-6 relative (FMA contraction and summation order differ;
# every parity test compares runs compiled alike). benchmarks/compile_opt_level.py
# measures it. Child processes inherit the flag; GPU-target compiles are unaffected (their
# collectives and bytes were compared equal). Set before the CPU backend starts.
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
    + ([FAST_CODEGEN] if _xla_knows(FAST_CODEGEN) else [])).strip()
# The suite is 8 CPU devices on any machine: on a GPU host the xdist workers would
# otherwise each claim the GPU (scripts/gpu_check.py is the GPU check).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", str(CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
os.environ.setdefault("FSDP_JAX_CACHE_DIR", str(CACHE))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small deterministic byte corpus (helpers.synthetic_corpus), prepared once per session."""
    from helpers import synthetic_corpus
    return synthetic_corpus(tmp_path_factory.mktemp("corpus"))
