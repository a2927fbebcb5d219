"""8 CPU devices for every test, a persistent compilation cache, deviceless target compiles kept
by their program, LLVM at -O0, and the shared corpus fixture."""

import json
import lzma
import os
import pathlib
import re
import subprocess
import sys
import time

import jax
import jaxlib
import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
CACHE = ROOT / ".jax_cache"
# XLA:CPU's older loop emitters compile the tiny decoder's step 2.8x faster than its MLIR fusion
# emitters, with the same collectives, argument bytes and loss (temp +256 B; two scatter-adds
# become while loops); benchmarks/compile_opt_level.py measures both. jaxlib 0.12.0.1 no
# longer registers the flag, and XLA aborts on an unknown XLA_FLAGS entry, so one child process
# tries the suite's flags once per jaxlib version (the answer is kept next to the compilation cache).
FAST_CODEGEN = "--xla_cpu_use_fusion_emitters=false"


def _known_flags(*flags: str) -> list[str]:
    """The flags this jaxlib's XLA accepts: a child process starts XLA with them; XLA aborts naming
    every flag it does not know, and a child with the rest confirms them (one child where all are
    known). The answer is kept per jaxlib version."""
    names = "+".join(f.strip("-").split("=")[0] for f in flags)
    memo = CACHE / f"xla-flags-{jaxlib.__version__}-{names}.json"
    try:
        return [f for f in json.loads(memo.read_text()) if f in flags]
    except (OSError, ValueError, TypeError):
        pass
    known = list(flags)
    while known:
        child = subprocess.run(
            [sys.executable, "-c", "import jax; jax.numpy.zeros(1).block_until_ready()"],
            env=dict(os.environ, XLA_FLAGS=" ".join(known), JAX_PLATFORMS="cpu"),
            capture_output=True,
            text=True,
        )
        if child.returncode == 0:
            break
        named = re.search(r"Unknown flags? in XLA_FLAGS: (.*)", child.stderr)
        rest = [f for f in known if not named or f not in named.group(1).split()]
        known = [] if rest == known else rest  # nothing named: none is trusted
    try:  # best effort: a read-only checkout probes again next time
        CACHE.mkdir(exist_ok=True)
        tmp = memo.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(known))
        tmp.replace(memo)
    except OSError:
        pass
    return known


# The tests check sharding, HLO, bytes and numerics, not the speed of XLA:CPU's machine
# code, and most of a CPU compile is LLVM optimising it: at -O0 the tiny decoder's init and
# step compile 2-3x faster with the same collectives and memory_analysis() bytes, and a
# bf16-compute loss within 7e-6 relative (FMA contraction and summation order differ;
# every parity test compares runs compiled alike). benchmarks/compile_opt_level.py
# measures it. Child processes inherit the flag; GPU-target compiles are unaffected (their
# collectives and bytes were compared equal). Set before the CPU backend starts.
# XLA:CPU splits a program's LLVM module into parts it compiles in parallel; with one xdist worker
# per core the parts only add work: one part compiled the tiny MoE step in 1.78 s of CPU instead of
# 2.17 (dense 1.09 / 1.40), and a cold tests/test_moe.py took 63.7-69.0 s of CPU instead of 76.2
# (loaded machine, one run each), the same tests passing (BENCHMARKS.md "Issue 55 item 6, why a
# tiny MoE step compiles slowly"). It changes how LLVM's work is split, not the optimized HLO; the
# deviceless target compiles' keys leave it out (fsdp_jax.targets.compile_cache), so
# tests/compiled's seeds still answer.
ONE_CODEGEN_PART = "--xla_cpu_parallel_codegen_split_count=1"
os.environ["XLA_FLAGS"] = " ".join(
    [os.environ.get("XLA_FLAGS", ""), "--xla_backend_optimization_level=0"]
    + _known_flags(FAST_CODEGEN, ONE_CODEGEN_PART)
).strip()
# The suite is 8 CPU devices on any machine: on a GPU host the xdist workers would
# otherwise each claim the GPU (scripts/gpu_check.py is the GPU check).
os.environ.setdefault("JAX_PLATFORMS", "cpu")
jax.config.update("jax_num_cpu_devices", 8)
jax.config.update("jax_compilation_cache_dir", str(CACHE))
jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
os.environ.setdefault("FSDP_JAX_CACHE_DIR", str(CACHE))
# Child processes (CLI runs, launchers' processes, `python -c` children) read and write the same
# cache, every compile included: jax's default keeps only compiles over 1 s, so a child compiled
# the tiny programs (init, eval, the small jits) again that the previous child had compiled
# (BENCHMARKS.md "Issue 55 item 6": CPU seconds of one tiny train child, before / after).
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(CACHE))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
# Deviceless XLA:TPU / XLA:GPU compiles kept by their program (fsdp_jax.targets.compile_cache):
# written under .jax_cache, read from there and from the committed seed folder tests/compiled
# (scripts/seed_compiled.py: the suite's longest target compiles). A program the code no longer
# lowers, or another jax, misses the seed and compiles.
os.environ.setdefault(
    "FSDP_JAX_COMPILED_CACHE", os.pathsep.join([str(CACHE / "compiled"), str(ROOT / "tests" / "compiled")])
)


# Heaviest files first, by their summed `--durations=0` seconds in a cold whole-suite run on
# 2 cores (offload 88, train_step 66, verify 46, checkpoint 44, targets 41, dropin 36,
# hostile 33, multihost 28, plan 27, trainer 15, scripts 15, memory_hlo 13, hf 11,
# observability 10, tensor_parallel 9, tokenizer 8, layering 5; the rest under 4; gpt_oss 16
# and deepseek_v3 14 measured alone, cold, `-m "not slow"`).
# pyproject's addopts turn off xdist's reordering by test count, so `--dist loadfile` hands
# files out in this order as workers free up (longest first): a 28 s file never starts last
# and leaves a core idle at the end. The order only affects wall time; files not listed
# follow in collection order.
HEAVY_FIRST = (
    # test_faults: one test of ~3-6 min wall, most of it waiting on killed peers' timeouts (2026-12-07):
    # started first, it never ends the run on one busy worker
    "test_faults.py",
    # deviceless TPU / GPU compiles, from the whole suite's --durations on 2026-12-06 (BENCHMARKS.md):
    # step_time_published ~760 s (its rows 6, 9, 5), flash_plan ~220 s, splash_plan ~150 s, ring_cudnn
    # ~130 s, search ~130 s; in collection order they started late and the suite ended on one busy worker
    "test_step_time_published.py",
    "test_flash_plan.py",
    "test_splash_plan.py",
    "test_ring_cudnn.py",
    "test_search.py",
    "test_offload.py",
    "test_train_step.py",
    "test_verify.py",
    "test_checkpoint.py",
    "test_targets.py",
    "test_dropin.py",
    "test_hostile.py",
    "test_multihost.py",
    "test_plan.py",
    "test_trainer.py",
    "test_scripts.py",
    "test_gpt_oss.py",
    "test_deepseek_v3.py",
    "test_memory_hlo.py",
    "test_hf.py",
    "test_observability.py",
    "test_tensor_parallel.py",
    "test_tokenizer.py",
    "test_layering.py",
)


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one xdist worker more than the cores. A cold whole suite on 2 cores with 2 workers kept
    them busy 63% of its wall time (3,351 s of CPU in 2,638 s, 2026-12-07: children starting up,
    2-process jobs waiting on each other, killed peers' timeouts, checkpoint I/O); a third worker runs
    while one waits. pyproject's --maxprocesses caps it. The fast subset (`-m "not slow"`) has almost no
    children to wait on: there a third worker only adds its start-up and contention (cold, quiet, 2 cores,
    2026-12-07: 2 min 10 s and 259 s of CPU with 3 workers, 2 min 5 s and 236 s with 2; BENCHMARKS.md)."""
    cores = os.cpu_count() or 1
    return cores if config.getoption("markexpr", "").strip() == "not slow" else cores + 1


def pytest_configure(config):
    """pytest's unraisable-exception plugin collects garbage 5 times when a process ends, to report
    what a finaliser raised; a worker that has compiled a few hundred programs holds millions of
    objects, and each full collection took ~1 s of its last seconds (gc_collect_harder, 2026-12-07,
    BENCHMARKS.md). One collection still runs the finalisers of the garbage left and reports them."""
    try:
        from _pytest.unraisableexception import gc_collect_iterations_key
    except ImportError:  # another pytest: its own default
        return
    config.stash[gc_collect_iterations_key] = 1


@pytest.hookimpl(tryfirst=True)  # before pytest's own hook deselects by marker (`-m "not slow"`)
def pytest_collection_modifyitems(items):
    rank = {name: i for i, name in enumerate(HEAVY_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order within a file kept
    _mark_slow_cases(items)


def _mark_slow_cases(items):
    """`@pytest.mark.fast_cases("id", ...)` on a parametrized test: the named cases stay in the fast
    subset, every other case is `slow` (the whole suite still runs them all). A named case that the
    test no longer has is an error, so a renamed parameter cannot quietly drop the fast case (checked
    where more than one case was collected: a node id naming one case collects only that one)."""
    named, seen = {}, {}
    for item in items:
        mark = item.get_closest_marker("fast_cases")
        if mark is None or not hasattr(item, "callspec"):
            continue
        key = item.nodeid.split("[")[0]
        named[key] = set(mark.args)
        seen.setdefault(key, set()).add(item.callspec.id)
        if item.callspec.id not in mark.args:
            item.add_marker(pytest.mark.slow)
    for key, ids in named.items():
        if len(seen[key]) > 1 and ids - seen[key]:
            raise pytest.UsageError(f"{key}: fast_cases {sorted(ids - seen[key])} are not among its cases")


SESSION_START = time.time()
SEED_MIN_S = 10.0  # tests/compiled/seed.py's default


def pytest_terminal_summary(terminalreporter):
    """Say how many long target compiles this run made that the seed folder did not answer. A
    program the seeds hold was compiled on purpose, not missed: a compile that dumps its HLO
    (`xla_dump_to`, as tests/test_fp8_hlo.py, test_qlora_plan.py and test_targets.py ask) never
    reads an entry (fsdp_jax.targets.compile_cache) and writes it again."""
    missed = []
    for path in (CACHE / "compiled").glob("*.json.xz"):
        try:
            if path.stat().st_mtime >= SESSION_START and not (ROOT / "tests" / "compiled" / path.name).exists():
                seconds = json.loads(lzma.decompress(path.read_bytes()))["compile_s"]
                if seconds >= SEED_MIN_S:
                    missed.append(seconds)
        except (OSError, ValueError, KeyError, lzma.LZMAError):
            continue
    if missed:
        terminalreporter.write_line(
            f"{len(missed)} target compiles of {sum(missed):.0f} s missed tests/compiled "
            "(after a whole run: python tests/compiled/seed.py)"
        )


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    """A small deterministic byte corpus (helpers.synthetic_corpus), prepared once per session."""
    from helpers import synthetic_corpus

    return synthetic_corpus(tmp_path_factory.mktemp("corpus"))
