"""What a test's child process pays before it does anything: CPU seconds of fresh Python
processes, measured alternately so a loaded machine's drift hits both sides alike.

    python benchmarks/child_startup.py imports --tree <old checkout> --tree . --runs 8
    XLA_FLAGS="--xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false" \
        python benchmarks/child_startup.py small-jits --runs 3      # the suite's flags (tests/conftest.py)

`imports`: `from fsdp_jax.app.cli.train import main` (what every CLI child imports) in each tree.
`small-jits`: 15 small programs (the kind a tiny train child compiles besides its init and step)
jitted in a fresh process with no compilation cache, then with a cache folder at min compile
time 0 (`tests/conftest.py` gives the suite's children that cache); the first cached run fills
the folder. Prints one line per run and the means (BENCHMARKS.md "Issue 55 item 6").
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

IMPORT = "from fsdp_jax.app.cli.train import main"
SMALL_JITS = """
import resource, jax, jax.numpy as jnp
jax.config.update("jax_num_cpu_devices", 8)
x = jax.block_until_ready(jnp.arange(1024.0).reshape(32, 32))
fns = [jnp.cos, jnp.sin, jnp.exp, jnp.tanh, jnp.sqrt, lambda a: a * 2, lambda a: a + 1, lambda a: a - 3,
       lambda a: a / 7, lambda a: jnp.clip(a, 0, 5), lambda a: a**3, lambda a: jnp.minimum(a, 2),
       lambda a: jnp.where(a > 3, a, 0), lambda a: a.astype(jnp.bfloat16), lambda a: a @ a]
r = resource.getrusage(resource.RUSAGE_SELF); c0 = r.ru_utime + r.ru_stime
for f in fns:
    jax.block_until_ready(jax.jit(f)(x))
r = resource.getrusage(resource.RUSAGE_SELF); print(r.ru_utime + r.ru_stime - c0)
"""


def _child_cpu(code: str, env: dict) -> float:
    """CPU seconds (user + sys) of one `python -c code` child."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run([sys.executable, "-c", code], env=env, check=True, capture_output=True)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def _env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JAX_COMPILATION", "JAX_PERSISTENT"))}
    env.pop("PYTHONDONTWRITEBYTECODE", None)  # as .ci/run: byte-code caching on
    return dict(env, JAX_PLATFORMS="cpu", **extra)


def imports(trees: list[Path], runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {str(t): [] for t in trees}
    for tree in trees:  # warm: byte-code written, files in the page cache
        _child_cpu(IMPORT, _env(PYTHONPATH=str(tree.resolve())))
    for i in range(runs):
        for tree in trees:
            out[str(tree)].append(_child_cpu(IMPORT, _env(PYTHONPATH=str(tree.resolve()))))
            print(f"run {i + 1} {tree}: {out[str(tree)][-1]:.2f} s CPU", flush=True)
    return out


def small_jits(runs: int) -> dict[str, list[float]]:
    out: dict[str, list[float]] = {"no cache": [], "cache, min 0 s": []}
    with tempfile.TemporaryDirectory() as cache:
        cached = _env(JAX_COMPILATION_CACHE_DIR=cache, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
        for i in range(runs):
            for name, env in (("no cache", _env()), ("cache, min 0 s", cached)):
                proc = subprocess.run([sys.executable, "-c", SMALL_JITS], env=env, check=True, capture_output=True)
                out[name].append(float(proc.stdout.split()[-1]))
                print(f"run {i + 1} {name}: {out[name][-1]:.3f} s CPU in the 15 jits", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=["imports", "small-jits"])
    ap.add_argument("--tree", type=Path, action="append", default=[], help="a checkout (imports; repeat)")
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args(argv)
    if args.runs < 1:
        print("error: --runs must be at least 1", file=sys.stderr)
        return 2
    if args.what == "imports":
        bad = [t for t in args.tree if not (t / "fsdp_jax" / "__init__.py").is_file()]
        if not args.tree or bad:
            got = ", ".join(map(str, bad)) or "none"
            print(f"error: --tree must name checkouts with fsdp_jax/ (got {got})", file=sys.stderr)
            return 2
        out = imports(args.tree, args.runs)
    else:
        out = small_jits(args.runs)
    for name, xs in out.items():
        print(f"{name}: mean {sum(xs) / len(xs):.3f} s CPU over {len(xs)} runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
