"""8 CPU devices for every test, a persistent compilation cache, and the shared
corpus fixture."""

import os
import pathlib

import jax
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
os.environ.setdefault("FSDP_JAX_CACHE_DIR", str(ROOT / ".jax_cache"))


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small deterministic byte corpus (helpers.synthetic_corpus), prepared once per session."""
    from helpers import synthetic_corpus
    return synthetic_corpus(tmp_path_factory.mktemp("corpus"))
