"""Encoding batches of fine-tuning examples in worker processes: in order, bounded.

    spec = EncoderSpec("ckpt/", eos=None, chat_template=src, specials={...}, train_on="targets")
    for items, examples in encode_batches(spec, batches, workers=4):
        ...                       # the same (items, examples) pairs, in the same order, as workers=1

Rendering a chat template is Python (jinja2) and holds the GIL, so threads cannot
spread it over cores: `workers` > 1 starts that many worker processes
(`fsdp_jax.app.data.encode_worker`), each a fresh interpreter started with `subprocess`
(never a fork of a process that runs JAX's or the tokenizer's threads; no
`if __name__ == "__main__"` guard needed), which loads the tokenizer and compiles the
template once and encodes whole batches. Nothing is pickled: batches go to a worker's
stdin as JSON, examples come back on its stdout as a JSON header and raw little-endian
token and mask bytes, in length-prefixed frames. The main process submits batches to
the worker with the fewest in hand and takes the results back strictly in input order,
with at most `2 x workers` batches in flight, so the output is byte for byte the output
of one worker and memory stays bounded by the batches in flight. An error is the one the
serial run would raise first, of the same class with the same message: a batch's
`ExampleError` comes before a read error in a later batch. A worker that dies (out of
memory, a signal) is an `OSError` naming it; the workers are ended and reaped when the
run ends, fails or is interrupted, and a worker whose parent dies ends at the end of
its stdin. Each worker's tokenizer gets `threads` threads (default 1 with several
workers: the processes are the parallelism).
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from fsdp_jax import errors
from fsdp_jax.app.data import encode_worker
from fsdp_jax.app.data.encode_worker import EncoderSpec
from fsdp_jax.app.data.examples import Example, ExampleEncoder


def encode_batches(
    spec: EncoderSpec, batches: Iterable[list], workers: int = 1, encoder: ExampleEncoder | None = None
) -> Iterator[tuple[list, list[Example]]]:
    """(items, `encoder.encode_batch(items)`) for each batch (a list) of (record, "file:line")
    items, in input order; `workers` processes (1: this process, with `encoder` if given).
    Anything else in `batches` (a long file the caller streams itself) comes back as
    (it, None), in its place in the order."""
    if workers < 1:
        raise ValueError(f"workers {workers}: must be >= 1")
    if workers == 1:
        enc = encoder or spec.build()
        for items in batches:
            yield items, (enc.encode_batch(items, spec.threads) if isinstance(items, list) else None)
        return
    pool = _Pool(spec, workers)
    pending: collections.deque = collections.deque()  # (items, the worker encoding them)
    done = False
    try:
        it = iter(batches)
        while True:
            try:
                items = next(it)
            except StopIteration:
                break
            except Exception:  # reading failed: an earlier batch's error comes first, as in order
                for _, w in pending:
                    pool.result(w)
                raise
            if not isinstance(items, list):  # not a batch (a long file): passed on, in order
                while pending:
                    first, w = pending.popleft()
                    yield first, pool.result(w)
                yield items, None
                continue
            pending.append((items, pool.submit(items)))
            if len(pending) >= 2 * workers:
                first, w = pending.popleft()
                yield first, pool.result(w)
        while pending:
            first, w = pending.popleft()
            yield first, pool.result(w)
        done = True
    finally:
        pool.close(kill=not done)


# The command that starts a worker (tests replace it to make a worker die).
WORKER_ARGV = [sys.executable, "-c", encode_worker.BOOT, str(Path(__file__).resolve().parents[2])]


class _Pool:
    """`workers` encoding processes; batch results are read back per worker, in the order
    each worker got its batches (so the caller's global order is each worker's order)."""

    def __init__(self, spec: EncoderSpec, workers: int):
        threads = spec.threads or 1
        env = dict(
            os.environ,
            RAYON_NUM_THREADS=str(threads),  # before `tokenizers` starts its pool
            TOKENIZERS_PARALLELISM="true" if threads > 1 else "false",
        )
        self.procs: list[subprocess.Popen] = []
        self.logs: list = []  # each worker's stderr, for the message if it dies
        self.in_hand: list[int] = []
        try:
            for _ in range(workers):
                log = tempfile.TemporaryFile()
                self.logs.append(log)
                self.procs.append(
                    subprocess.Popen(WORKER_ARGV, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env)
                )
                self.in_hand.append(0)
            spec_json = json.dumps(dataclasses.asdict(spec)).encode()
            for i in range(workers):
                self._send(i, spec_json)
        except BaseException:
            self.close(kill=True)
            raise

    def submit(self, items: list) -> int:
        """Send a batch to the worker with the fewest batches in hand; returns that worker."""
        i = min(range(len(self.procs)), key=lambda k: self.in_hand[k])
        self._send(i, json.dumps([[rec, where] for rec, where in items]).encode())
        self.in_hand[i] += 1
        return i

    def result(self, i: int) -> list[Example]:
        """Worker `i`'s next batch of examples; its error, raised as the class it was."""
        head = self._read(i)
        self.in_hand[i] -= 1
        header = json.loads(head)
        if "error" in header:
            raise _error(header)
        body = self._read(i)
        lens = np.asarray(header["lens"], np.int64)
        total = int(lens.sum())
        tokens = np.frombuffer(body, "<i4", total)
        mask = np.frombuffer(body, np.uint8, total, offset=4 * total)
        ends = np.cumsum(lens)
        return [
            Example(tokens[e - n : e], mask[e - n : e], kind, bool(dropped))
            for e, n, kind, dropped in zip(ends.tolist(), lens.tolist(), header["kinds"], header["dropped"])
        ]

    def _send(self, i: int, payload: bytes) -> None:
        try:
            encode_worker.write_frame(self.procs[i].stdin, payload)
            self.procs[i].stdin.flush()
        except (BrokenPipeError, ConnectionResetError):
            raise self._died(i) from None

    def _read(self, i: int) -> bytearray:
        try:
            frame = encode_worker.read_frame(self.procs[i].stdout)
        except EOFError:
            frame = None
        if frame is None:
            raise self._died(i)
        return frame

    def _died(self, i: int) -> OSError:
        p = self.procs[i]
        try:
            code = p.wait(5)
        except subprocess.TimeoutExpired:
            code = None
        if code is None:
            how = "stopped answering"
        elif code < 0:
            try:
                how = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                how = f"was killed by signal {-code}"
        else:
            how = f"exited with code {code}"
        self.logs[i].seek(0)
        last = [ln for ln in self.logs[i].read()[-2000:].decode(errors="replace").splitlines() if ln.strip()]
        why = f": {last[-1].strip()[:200]}" if last else " (out of memory, or a signal)"
        return OSError(f"encoding worker {i + 1} of {len(self.procs)} (pid {p.pid}) {how}{why}")

    def close(self, kill: bool) -> None:
        """End the workers (at the end of their stdin, or killed) and reap them."""
        for p in self.procs:
            if kill:
                p.kill()
            try:
                p.stdin.close()
            except OSError:
                pass
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            p.stdout.close()
        for log in self.logs:
            log.close()


def _error(reply: dict) -> Exception:
    """A worker's error (`encode_worker.error_reply`) as the class the serial run raises:
    the project's errors (`fsdp_jax.errors`) and Python's built-in exceptions by name, made
    from the same arguments; anything else a RuntimeError naming it."""

    name, message = reply["error"], reply["message"]
    cls = getattr(errors, name, None) or getattr(builtins, name, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(*reply.get("args", [message]))
        except (TypeError, ValueError):  # a class that wants other arguments: named below
            pass
    return RuntimeError(f"an encoding worker failed: {name}: {message}")
