"""JAX's coordination service in a small process of its own, beside process 0.

`jax.distributed.initialize` starts the coordination service inside process 0. When
process 0 dies, every other process's client loses the service and JAX aborts it at once
from C++ (a multi-line log, exit 134), before any Python thread can say which process
died. With the service in a child process of process 0 (`service_outside`), the
survivors keep a live service: their peer watch (fsdp_jax.multihost.peer_watch) sees process 0's
beats stop and stops them in one line naming it.

The child (`python -m fsdp_jax.multihost.coordination ARGS`) starts the service with exactly the
arguments JAX would have used, prints "ready", then serves until process 0 exits: right
after a normal end (process 0 writes "done" to its stdin first), else after `linger_s`
so the survivors' watches can speak (they need a live service to read the beats).
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import subprocess
import sys
import time

# jaxlib's runtime only, not the `jax` package: the child starts in ~0.25 s of CPU, not ~1.6 s (it is
# the `_jax` that jax._src.distributed calls, whose service function `service_outside` replaces)
from jaxlib import _jax

from fsdp_jax.errors import one_line

AFTER_DONE_S = 5.0  # the others' shutdown barrier completes with process 0's: a short wait


class _Outside:
    """Stands for the service object in JAX's global state; the service is the child."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc

    def done(self) -> None:
        with contextlib.suppress(OSError, ValueError):
            self.proc.stdin.write("done\n")
            self.proc.stdin.flush()

    def shutdown(self) -> None:  # JAX's shutdown: the child follows process 0's exit
        self.done()


_CHILD: _Outside | None = None


def start(args: tuple, kwargs: dict, linger_s: float, timeout_s: float = 60.0) -> _Outside:
    """Start the child with JAX's arguments; RuntimeError (one line) when it cannot."""
    global _CHILD
    proc = subprocess.Popen(
        [sys.executable, "-m", "fsdp_jax.multihost.coordination", json.dumps([list(args), kwargs]), str(linger_s)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        bufsize=1,
    )
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    line = proc.stdout.readline().strip() if ready else ""
    if line != "ready":
        proc.kill()
        rest = line or f"no answer within {timeout_s:g} s"
        raise RuntimeError(f"the coordination service process did not start: {rest[:300]}")
    _CHILD = _Outside(proc)
    return _CHILD


@contextlib.contextmanager
def service_outside(linger_s: float):
    """Within the block, `jax.distributed.initialize` on process 0 starts its service in
    a child process. A JAX without the hook it replaces keeps its own service."""

    lib = getattr(sys.modules.get("jax._src.distributed"), "_jax", None)  # loaded with `jax`
    real = getattr(lib, "get_distributed_runtime_service", None)
    if real is None:
        yield
        return

    def outside(*args, **kwargs):
        return start(args, kwargs, linger_s)

    lib.get_distributed_runtime_service = outside
    try:
        yield
    finally:
        lib.get_distributed_runtime_service = real


def finished() -> None:
    """Process 0 ends normally: the child stops shortly after process 0 exits."""
    if _CHILD is not None:
        _CHILD.done()


def _serve(spec: str, linger_s: float) -> int:
    args, kwargs = json.loads(spec)
    try:
        service = _jax.get_distributed_runtime_service(*args, **kwargs)
    except Exception as e:  # e.g. the port is taken
        print(f"{type(e).__name__}: {one_line(e, None)}", flush=True)
        return 1
    print("ready", flush=True)
    devnull = os.open(os.devnull, os.O_WRONLY)  # nobody reads our output any more
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    parent, done = os.getppid(), False
    assert service is not None
    while os.getppid() == parent:
        ready, _, _ = select.select([sys.stdin], [], [], 0.5)
        if ready:
            line = sys.stdin.readline()
            done = done or line.strip() == "done"
            if not line:  # process 0 closed its end: it has exited
                break
    time.sleep(AFTER_DONE_S if done else linger_s)
    os._exit(0)  # (the service's destructor may wait for clients that are gone)


if __name__ == "__main__":
    sys.exit(_serve(sys.argv[1], float(sys.argv[2])))
