"""A pytest plugin that says where a test run's JAX time goes: jax's own compile-phase
durations (`jax.monitoring`: tracing to a jaxpr, jaxpr to MLIR, the backend compile), summed
over the run and per test with the test's CPU seconds, and the backend compiles by function name.

    PYTHONPATH=$PWD:$PWD/benchmarks python -m pytest -p pytest_jax_times -p no:cacheprovider -n 0 tests/FILE.py

Only in one process (`-n 0`): xdist workers would each print their own share. Lines start
with JAXTIMES (totals, the 15 costliest tests) and JAXNAME (the 25 costliest jitted names).
"""

import collections
import logging
import re
import resource

import jax
import pytest

PHASES = (
    "/jax/core/compile/jaxpr_trace_duration",
    "/jax/core/compile/jaxpr_to_mlir_module_duration",
    "/jax/core/compile/backend_compile_duration",
)
_total, _count, _current = collections.Counter(), collections.Counter(), collections.Counter()
_per_test: dict[str, tuple[float, dict]] = {}
_by_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])


def _listen(event, duration, **_):
    _total[event] += duration
    _count[event] += 1
    _current[event] += duration


jax.monitoring.register_event_duration_secs_listener(_listen)


class _Compiles(logging.Handler):
    """jax logs "Finished XLA compilation of NAME in S sec" at debug level (warning with jax_log_compiles)."""

    def emit(self, record):
        m = re.match(r"Finished XLA compilation of (.*) in ([0-9.]+) sec", record.getMessage())
        if m:
            _by_name[m.group(1)][0] += float(m.group(2))
            _by_name[m.group(1)][1] += 1


for _logger in ("jax._src.dispatch", "jax._src.interpreters.pxla"):
    logging.getLogger(_logger).addHandler(_Compiles(logging.DEBUG))
    logging.getLogger(_logger).setLevel(logging.DEBUG)


def _cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    _current.clear()
    start = _cpu()
    yield
    _per_test[item.nodeid] = (_cpu() - start, dict(_current))


def pytest_terminal_summary(terminalreporter):
    write = terminalreporter.write_line
    write("JAXTIMES total: " + ", ".join(f"{k.split('/')[-1]} {_total[k]:.1f} s / {_count[k]}" for k in PHASES))
    for nodeid, (cpu, d) in sorted(_per_test.items(), key=lambda x: -x[1][0])[:15]:
        trace, mlir, backend = (d.get(k, 0.0) for k in PHASES)
        write(f"JAXTIMES {cpu:7.2f} s CPU: trace {trace:6.2f} mlir {mlir:6.2f} compile {backend:6.2f}  {nodeid}")
    for name, (s, n) in sorted(_by_name.items(), key=lambda x: -x[1][0])[:25]:
        write(f"JAXNAME {s:7.2f} s {n:4d}  {name}")
