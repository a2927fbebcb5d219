"""Stop the survivors of a multi-process job, in one line, when a peer stops responding.

When one process of a `jax.distributed` job dies (kill -9, out of memory) and its
launcher does not stop the others (SLURM without `--kill-on-bad-exit`, mpirun), the
survivors sit in a collective with it. JAX's coordination service notices the missing
heartbeats after `heartbeat_timeout_seconds` and aborts them from C++ (a multi-line
log, exit 134); jaxlib offers no hook to replace that abort (its
`missed_heartbeat_callback` is called with an `absl::Status` that has no Python type:
`std::bad_cast`, then `terminate`, on jaxlib 0.10 and 0.12 alike).

`PeerWatch` is a daemon thread in every process that beats through the coordination
service's key-value store (one key per process, a counter) and exits first:

* process 0 reads every beat each interval; a process whose counter has not moved for
  `timeout_s` is declared gone: process 0 publishes that (one key), waits briefly for
  the others to read it, prints one line naming the process and exits 1;
* every other process reads that key and process 0's beat each interval: it prints the
  same line and exits 1 (process 0 silent: it names process 0).

The thread keeps running while the main thread is blocked in a collective (the
key-value calls and XLA's compiles release the GIL), so it exits with `os._exit(1)`.
A process that ends normally calls `finish()`: its beat becomes "done" and nobody
waits for it. Process 0 itself dying would take the coordination service down with it
(JAX's clients abort at once when the service is gone): fsdp_jax.multihost.distributed runs the
service in a child of process 0 while a watch is on (fsdp_jax.multihost.coordination), so the
others read process 0's silence like any other.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable

PREFIX = "fsdp_jax/multihost/peer_watch/"
DONE = "done"


def beat_key(process: int) -> str:
    return f"{PREFIX}beat/{process}"


DEAD_KEY = PREFIX + "dead"


def interval_for(timeout_s: float) -> float:
    """Seconds between beats: a sixth of the timeout, within [0.1, 5]."""
    return min(5.0, max(0.1, timeout_s / 6))


def jax_heartbeat_for(timeout_s: float) -> int:
    """JAX's own heartbeat timeout while a watch runs: far enough past ours (3x, at least
    JAX's default 100 s) that the watch always speaks first."""
    return max(100, int(3 * timeout_s) + 1)


def describe(process: int, num_processes: int, silent_s: float, me: int, note: str = "") -> str:
    """The one line (without "error: ") a survivor prints."""
    who = "the coordinator, process 0" if process == 0 else f"process {process}"
    line = (
        f"{who} of {num_processes} stopped responding (no heartbeat for {silent_s:.0f} s: "
        f"killed, out of memory, or hung); stopping process {me}"
    )
    return f"{line}; {note}" if note else line


# What the coordination service's client raises (jax.errors.JaxRuntimeError: NOT_FOUND,
# ALREADY_EXISTS, the service unreachable) is a RuntimeError; anything else is a bug and surfaces.
STORE_ERRORS = (RuntimeError,)


class Silence:
    """When each watched process's beat last changed, on this process's clock."""

    def __init__(self, processes, start: float):
        self.last = {p: (None, start) for p in processes}
        self.done: set[int] = set()

    def observe(self, beats: dict[int, str], now: float, timeout_s: float) -> list[tuple[int, float]]:
        """Record `beats` (process -> value; absent: not seen this time) and return the
        processes silent for more than `timeout_s`, with how long, oldest first."""
        stale = []
        for p, (value, since) in self.last.items():
            if p in self.done:
                continue
            v = beats.get(p)
            if v == DONE:
                self.done.add(p)
                continue
            if v is not None and v != value:
                self.last[p] = (v, now)
            elif now - since > timeout_s:
                stale.append((p, now - since))
        return sorted(stale, key=lambda x: -x[1])


class PeerWatch:
    """The watch thread of one process (see the module docstring). `client` is JAX's
    DistributedRuntimeClient (key_value_set / key_value_try_get / key_value_dir_get)."""

    def __init__(
        self,
        client,
        process_id: int,
        num_processes: int,
        timeout_s: float,
        note: str = "",
        exit_fn: Callable[[int], None] = os._exit,
        stream=None,
        clock=time.monotonic,
    ):
        self.client, self.me, self.n = client, process_id, num_processes
        self.timeout_s, self.note = float(timeout_s), note
        self.interval = interval_for(self.timeout_s)
        self.exit_fn, self.stream, self.clock = exit_fn, stream, clock
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._count = 0

    # -- the store --------------------------------------------------------------------------------

    def _get(self, key: str) -> str | None:
        try:
            return self.client.key_value_try_get(key)
        except STORE_ERRORS:  # NOT_FOUND, or the coordinator unreachable: nothing seen this time
            return None

    def _beat(self) -> None:
        self._count += 1
        with contextlib.suppress(*STORE_ERRORS):  # a failed write: the watch carries on
            self.client.key_value_set(beat_key(self.me), str(self._count), allow_overwrite=True)

    def _all_beats(self) -> dict[int, str]:
        try:
            entries = self.client.key_value_dir_get(PREFIX + "beat/")
        except STORE_ERRORS:  # the coordinator unreachable: nothing seen this time
            return {}
        out = {}
        for key, value in entries:
            tail = key.rsplit("/", 1)[-1]
            if tail.isdigit():
                out[int(tail)] = value
        return out

    # -- the thread -------------------------------------------------------------------------------

    def start(self) -> PeerWatch:
        self._beat()
        self._thread = threading.Thread(target=self._run, name="fsdp_jax-peer-watch", daemon=True)
        self._thread.start()
        return self

    def await_verdict(self) -> None:
        """For an error that a dead peer may have caused (a collective failing with
        "connection reset by peer", a save whose barrier failed): block until every other
        process has beaten again (they are alive: return, the error is the news) or the
        watch finds one gone, names it in its line and stops this process (no return).
        At most the timeout, a few beats and process 0's wait for the others."""
        if self._thread is None or self._stop.is_set():
            return
        others = [p for p in range(self.n) if p != self.me]
        before = self._all_beats()
        deadline = self.clock() + self.timeout_s + 6 * self.interval + 3.0
        while self._thread.is_alive() and self.clock() < deadline:
            self._thread.join(self.interval)
            now = self._all_beats()
            if all(now.get(p) == DONE or now.get(p) not in (None, before.get(p)) for p in others):
                return

    def finish(self) -> None:
        """This process ended normally: nobody waits for its beats any more."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
        with contextlib.suppress(*STORE_ERRORS):  # a failed write: the watch carries on
            self.client.key_value_set(beat_key(self.me), DONE, allow_overwrite=True)

    def _run(self) -> None:
        others = [p for p in range(self.n) if p != self.me]
        silence = Silence(others if self.me == 0 else [0], self.clock())
        while not self._stop.wait(self.interval):
            self._beat()
            if self.me == 0:
                stale = silence.observe(self._all_beats(), self.clock(), self.timeout_s)
                if stale:
                    return self._stop_job(*stale[0], silence)
            else:
                published = self._get(DEAD_KEY)
                if published is not None:
                    return self._stop_here(published)
                stale = silence.observe({0: self._get(beat_key(0))}, self.clock(), self.timeout_s)
                if stale:
                    return self._stop_here(f"0 {stale[0][1]:.3f}")

    def _stop_job(self, process: int, silent_s: float, silence: Silence) -> None:
        """Process 0: publish the dead process, give the others a few intervals to read it
        (its own exit takes the coordination service down with it), then stop."""
        if self._stop.is_set():
            return
        with contextlib.suppress(*STORE_ERRORS):  # a failed write: the watch carries on
            self.client.key_value_set(DEAD_KEY, f"{process} {silent_s:.3f}", allow_overwrite=True)
        waiting = {p for p in range(1, self.n) if p != process and p not in silence.done}
        deadline = self.clock() + 3 * self.interval + 2.0
        while waiting and self.clock() < deadline:
            waiting = {p for p in waiting if self._get(f"{PREFIX}ack/{p}") is None}
            time.sleep(min(0.1, self.interval))
        self._say_and_exit(process, silent_s)

    def _stop_here(self, published: str) -> None:
        if self._stop.is_set():
            return
        with contextlib.suppress(*STORE_ERRORS):  # a failed write: the watch carries on
            self.client.key_value_set(f"{PREFIX}ack/{self.me}", "1", allow_overwrite=True)
        head, _, tail = published.partition(" ")
        try:
            process, silent_s = int(head), float(tail)
        except ValueError:
            process, silent_s = 0, self.timeout_s
        self._say_and_exit(process, silent_s)

    def _say_and_exit(self, process: int, silent_s: float) -> None:
        stream = self.stream or sys.stderr
        for s in (sys.stdout, stream):
            with contextlib.suppress(OSError, ValueError):  # a closed or broken stream
                s.flush()
        try:
            stream.write(f"error: {describe(process, self.n, silent_s, self.me, self.note)}\n")
            stream.flush()
        finally:
            self.exit_fn(1)
