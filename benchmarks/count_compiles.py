"""A pytest plugin that counts the XLA compiles the test suite really runs (persistent
cache misses) and the seconds each took, by program name and by test; and a summary.

    PYTHONPATH=benchmarks python -m pytest -p count_compiles      # writes compile_counts/*.json
    python benchmarks/count_compiles.py compile_counts            # prints the summary

Run it on a fresh clone (empty `.jax_cache/`) to see what a cold suite compiles; child
processes (scripts run by subprocess tests) are not counted. This is where the suite's
cold time goes (CONTRIBUTING.md "Tests")."""

import collections
import hashlib
import json
import os
import sys
import time
from pathlib import Path

OUT = Path(os.environ.get("COUNT_COMPILES_DIR", "compile_counts"))
_rows: list = []
_current = {"test": None}


def _install() -> None:
    import jax._src.compiler as compiler  # the one call every cache miss goes through

    original = compiler.backend_compile_and_load

    def counted(backend, module, *args, **kwargs):
        t = time.perf_counter()
        try:
            return original(backend, module, *args, **kwargs)
        finally:
            s = time.perf_counter() - t
            name = str(module.operation.attributes["sym_name"]).strip('"')
            text = module.operation.get_asm(enable_debug_info=False)
            _rows.append((_current["test"], name, s, hashlib.sha1(text.encode()).hexdigest()[:12]))

    compiler.backend_compile_and_load = counted


def pytest_configure(config):
    _install()


def pytest_runtest_logstart(nodeid, location):
    _current["test"] = nodeid


def pytest_sessionfinish(session):
    OUT.mkdir(exist_ok=True)
    worker = os.environ.get("PYTEST_XDIST_WORKER", "main")
    (OUT / f"{worker}.json").write_text(json.dumps(_rows))


def summary(folder: Path) -> str:
    rows = [r for f in sorted(folder.glob("*.json")) for r in json.loads(f.read_text())]
    by_name, count, by_file = collections.Counter(), collections.Counter(), collections.Counter()
    seen, repeat_s = set(), 0.0
    for test, name, s, digest in rows:
        by_name[name] += s
        count[name] += 1
        by_file[(test or "?").split("::")[0]] += s
        repeat_s += s if digest in seen else 0.0
        seen.add(digest)
    lines = [
        f"{len(rows)} compiles, {sum(by_name.values()):.0f} s; {len(seen)} distinct programs "
        f"({repeat_s:.0f} s compiling a program again)",
        "",
        "seconds  compiles  program",
    ]
    lines += [f"{s:7.1f}  {count[n]:8d}  {n}" for n, s in by_name.most_common(10)]
    lines += ["", "seconds  test file"] + [f"{s:7.1f}  {f}" for f, s in by_file.most_common(15)]
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    folder = Path(argv[0] if argv else OUT)
    try:
        if not any(folder.glob("*.json")):
            raise ValueError("no *.json files (run pytest with -p count_compiles first)")
        print(summary(folder))
    except (OSError, ValueError, TypeError) as e:  # ValueError: bad JSON or rows
        print(f"error: {folder}: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
