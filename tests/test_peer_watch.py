"""A peer that stops responding in a multi-process job whose launcher does not stop the
others (SLURM without --kill-on-bad-exit, mpirun): the survivors stop in bounded time with
one line naming the process, exit 1, before JAX's coordination service aborts them from
C++ (exit 134). fsdp_jax/multihost/peer_watch.py; the launcher-stops-the-job case is in
tests/test_faults.py."""

import io
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fsdp_jax.multihost import peer_watch as pw
from helpers import one_line

ROOT = Path(__file__).resolve().parents[1]


# -- the silence tracker, table-driven --------------------------------------------------------------

# (observations [(now, {process: beat})], timeout, the stale processes after the last one)
SILENCE_CASES = {
    "beats that move are never stale": ([(1, {1: "1"}), (2, {1: "2"}), (3, {1: "3"}), (9, {1: "4"})], 2, []),
    "a beat that stops moving is stale past the timeout": ([(1, {1: "1"}), (2, {1: "1"}), (3.5, {1: "1"})], 2, [1]),
    "not past the timeout yet": ([(1, {1: "1"}), (2.9, {1: "1"})], 2, []),
    "never seen: silent since the watch started": ([(1, {}), (2.5, {})], 2, [1]),
    "unreadable (absent) counts as silence": ([(1, {1: "1"}), (2, {}), (3.5, {})], 2, [1]),
    "done is never stale": ([(1, {1: "1"}), (2, {1: pw.DONE}), (50, {})], 2, []),
    "the longest silent first": ([(0.5, {1: "1", 2: "1"}), (1, {1: "1", 2: "2"}), (4, {1: "1", 2: "2"})], 2, [1, 2]),
    "only the silent one of two": ([(1, {1: "1", 2: "1"}), (3.5, {1: "2", 2: "1"})], 2, [2]),
}


@pytest.mark.parametrize("case", SILENCE_CASES)
def test_silence_tracker(case):
    observations, timeout, want = SILENCE_CASES[case]
    s = pw.Silence([1, 2] if any(2 in b for _, b in observations) else [1], start=0.0)
    for now, beats in observations:
        stale = s.observe(beats, now, timeout)
    assert [p for p, _ in stale] == want
    assert all(silent > timeout for _, silent in stale)


def test_the_watch_speaks_before_jax_heartbeat_and_beats_often_enough():
    for t in (0.5, 3, 60, 600, 86400):
        assert pw.jax_heartbeat_for(t) >= max(100, 2 * t)
        assert 0.1 <= pw.interval_for(t) <= min(5.0, max(0.1, t / 3))
    line = pw.describe(3, 8, 61.4, 0, "resume")
    assert line == (
        "process 3 of 8 stopped responding (no heartbeat for 61 s: killed, out of memory, "
        "or hung); stopping process 0; resume"
    )
    assert pw.describe(0, 2, 5, 1).startswith("the coordinator, process 0 of 2 stopped responding")


# -- the watch thread against an in-memory store ------------------------------------------------------


class Store:
    """The three key-value calls of JAX's DistributedRuntimeClient, in memory."""

    def __init__(self):
        self.kv, self.lock = {}, threading.Lock()

    def key_value_set(self, key, value, allow_overwrite=False):
        with self.lock:
            if key in self.kv and not allow_overwrite:
                raise RuntimeError(f"ALREADY_EXISTS: {key}")
            self.kv[key] = value

    def key_value_try_get(self, key):
        with self.lock:
            if key not in self.kv:
                raise RuntimeError(f"NOT_FOUND: {key}")
            return self.kv[key]

    def key_value_dir_get(self, prefix):
        with self.lock:
            return [(k, v) for k, v in self.kv.items() if k.startswith(prefix)]


def _watch(store, me, n, timeout=0.6):
    exits, out = [], io.StringIO()
    done = threading.Event()

    def exit_fn(code):
        exits.append(code)
        done.set()

    return pw.PeerWatch(store, me, n, timeout, note="note", exit_fn=exit_fn, stream=out), exits, out, done


def _beating(store, process, stop):
    def run():
        i = 0
        while not stop.is_set():
            i += 1
            store.key_value_set(pw.beat_key(process), str(i), allow_overwrite=True)
            time.sleep(0.05)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


def test_process_0_names_the_silent_peer_publishes_it_and_waits_for_the_others():
    store, stop = Store(), threading.Event()
    _beating(store, 1, stop)
    w, exits, out, done = _watch(store, 0, 3)  # process 2 never beats; 1 does
    acked = []

    def ack_when_published():  # process 1 reading the verdict
        while pw.DEAD_KEY not in store.kv:
            time.sleep(0.01)
        acked.append(time.monotonic())
        store.key_value_set(f"{pw.PREFIX}ack/1", "1")

    threading.Thread(target=ack_when_published, daemon=True).start()
    t0 = time.monotonic()
    w.start()
    assert done.wait(10), "the watch never stopped the process"
    stop.set()
    assert exits == [1] and 0.6 < time.monotonic() - t0 < 5
    assert store.kv[pw.DEAD_KEY].split()[0] == "2" and acked
    assert out.getvalue().startswith("error: process 2 of 3 stopped responding") and out.getvalue().count("\n") == 1
    assert "stopping process 0; note" in out.getvalue()


@pytest.mark.parametrize("published, who", [(None, "the coordinator, process 0 of 2"), ("1 7.2", "process 1 of 3")])
def test_other_processes_stop_on_the_verdict_or_a_silent_coordinator(published, who):
    store = Store()
    store.key_value_set(pw.beat_key(0), "1")  # process 0 beats once, then nothing
    if published:
        store.key_value_set(pw.DEAD_KEY, published)
    w, exits, out, done = _watch(store, 1 if published is None else 2, 2 if published is None else 3)
    w.start()
    assert done.wait(10) and exits == [1]
    assert out.getvalue().startswith(f"error: {who} stopped responding"), out.getvalue()
    if published:
        assert f"{pw.PREFIX}ack/2" in store.kv and "no heartbeat for 7 s" in out.getvalue()


def test_a_finished_process_is_not_waited_for():
    store, stop = Store(), threading.Event()
    _beating(store, 0, stop)
    w1, exits1, _, _ = _watch(store, 1, 2)
    w1.start()
    time.sleep(0.3)
    w1.finish()
    assert store.kv[pw.beat_key(1)] == pw.DONE
    w0, exits0, _, done0 = _watch(store, 0, 2)
    w0.start()
    assert not done0.wait(2.0)  # 3x the timeout: process 1 finished, nobody is silent
    w0.finish()
    stop.set()
    assert exits0 == exits1 == []


# -- real processes: gloo collectives, one killed ----------------------------------------------------


def _start_job(
    n: int, victim: int, steps: int, timeout_s: float, port: int, tail_s: float = 0
) -> list[subprocess.Popen]:
    procs = []
    for i in range(n):
        env = dict(
            os.environ,
            PYTHONPATH=str(ROOT),
            JAX_PLATFORMS="cpu",
            FSDP_JAX_COORDINATOR=f"127.0.0.1:{port}",
            FSDP_JAX_NUM_PROCESSES=str(n),
            FSDP_JAX_PROCESS_ID=str(i),
            PEER_JOB_VICTIM=str(victim),
            PEER_JOB_STEPS=str(steps),
            PEER_JOB_TIMEOUT_S=str(timeout_s),
            PEER_JOB_TAIL_S=str(tail_s),
            PYTHONUNBUFFERED="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, str(ROOT / "tests" / "peer_job.py")],
                env=env,
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    return procs


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
@pytest.mark.parametrize("victim, who", [(2, "process 2 of 3"), (0, "the coordinator, process 0 of 3")])
def test_survivors_of_a_killed_peer_stop_in_bounded_time_with_one_line(victim, who):
    """3 processes in a loop of cross-process sums; one kills itself (SIGKILL) after step
    5, leaving the other two blocked in the next sum. Each stops on its own (no launcher
    stops it) within the peer timeout plus a few beats, one line naming the dead process,
    exit 1; JAX's abort never comes. Mutations: no watch -> JAX's heartbeat abort after
    100 s (process 2) or at once (process 0); the service inside process 0 (no
    coord_service child) -> process 0's death aborts the others at once (exit 134)."""
    timeout_s = 4.0
    procs = _start_job(3, victim=victim, steps=5, timeout_s=timeout_s, port=_free_port())
    survivors = [i for i in range(3) if i != victim]
    try:
        procs[victim].wait(timeout=240)
        killed_at = time.monotonic()
        results = {i: procs[i].communicate(timeout=60) for i in survivors}
        stopped_in = time.monotonic() - killed_at
    finally:
        for p in procs:
            p.kill()
    assert procs[victim].returncode == -signal.SIGKILL
    for i, (out, err) in results.items():
        line = one_line(
            procs[i].returncode, err, f"{who} stopped responding", f"stopping process {i}", "test note", code=1
        )
        assert "step 5" in out, out[-500:]
    assert stopped_in < timeout_s + 3 * pw.interval_for(timeout_s) + 4, (stopped_in, line)


@pytest.mark.slow
def test_a_job_that_ends_normally_is_not_stopped():
    """Every process finishes (finished() marks it done); process 0 then works alone for 3x
    the peer timeout after process 1 has exited: no peer is reported, both exit 0 and print
    nothing on stderr. Mutation: finish() not marking the beat done -> process 0 reports
    process 1."""
    procs = _start_job(2, victim=-1, steps=30, timeout_s=1.0, port=_free_port(), tail_s=3.0)
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0 and "step 30" in out and "error" not in err, err[-2000:]


def test_awaiting_the_verdict_returns_once_every_peer_beats_again_and_never_when_one_is_gone():
    """After an error in a step: peers that still beat -> return within a few beats (the
    error is reported); a silent peer -> the watch stops the process naming it."""
    store, stop = Store(), threading.Event()
    _beating(store, 1, stop)
    _beating(store, 2, stop)
    w, exits, out, done = _watch(store, 0, 3)
    w.start()
    t0 = time.monotonic()
    w.await_verdict()
    assert time.monotonic() - t0 < 4 * w.interval + 0.5 and exits == []
    stop.set()  # now both go silent
    w.await_verdict()
    assert done.wait(5) and exits == [1] and "stopped responding" in out.getvalue()
