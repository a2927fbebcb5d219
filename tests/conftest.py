"""8 CPU devices for every test, and a persistent compilation cache."""

import os
import pathlib

import jax

ROOT = pathlib.Path(__file__).resolve().parents[1]
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
os.environ.setdefault("FSDP_JAX_CACHE_DIR", str(ROOT / ".jax_cache"))
