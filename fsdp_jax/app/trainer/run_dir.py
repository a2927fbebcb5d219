"""A run directory: checks before anything is written, and one writer at a time.

    check_dir_path(cfg.run_dir, "run_dir")       # ConfigError: a file, under a file, read-only
    with RunDirLock(cfg.run_dir):                # RunDirBusy when another trainer holds it
        ...                                      # config.yaml, metrics.jsonl, checkpoints

The lock is an exclusive `fcntl.flock` on `<run_dir>/.lock`, held by process 0 of a
run for its whole length; the file names the holder (pid, host, start time) for the
message a second trainer prints. The kernel drops a flock when its process dies, so
a `kill -9`ed run leaves no stale lock: the next start resumes. With several
processes, process 0 decides and the others learn its answer (they never touch the
lock, so they are never refused by it).
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path

import jax
import numpy as np
from jax.experimental import multihost_utils

from fsdp_jax.app.data.writable import dir_problem
from fsdp_jax.errors import ConfigError, RunDirBusy

LOCK_NAME = ".lock"


def check_dir_path(path: str, key: str) -> None:
    """ConfigError naming `key` unless `path` is, or can be created as, a writable
    directory: not a file, not under a file, its nearest existing ancestor writable.
    Writes nothing."""
    problem = dir_problem(path)
    if problem:
        raise ConfigError(key, f"{path!r} {problem}")


def _holder(fd: int) -> str:
    os.lseek(fd, 0, os.SEEK_SET)
    try:
        h = json.loads(os.read(fd, 4096) or b"{}")
        return f"pid {h['pid']} on host {h['host']}, since {h['since']}"
    except (ValueError, KeyError, TypeError):
        return "holder unknown"


class RunDirLock:
    """Exclusive use of a run directory by one (multi-process) run; a context manager.
    Creates the directory. Raises RunDirBusy (held by a live process) or ConfigError
    (the directory cannot be created)."""

    def __init__(self, run_dir: str | os.PathLike, key: str = "run_dir"):
        self.run_dir, self.key = Path(run_dir), key
        self._fd: int | None = None
        self._created = False

    def __enter__(self) -> "RunDirLock":
        status, msg = 0, ""
        if jax.process_index() == 0:
            status, msg = self._acquire()
        if jax.process_count() > 1:  # every process stops together, with process 0's reason
            status = int(multihost_utils.broadcast_one_to_all(np.int32(status)))
            msg = msg or f"process 0 could not lock {self.run_dir} (see its output)"
        if status == 1:
            raise RunDirBusy(msg)
        if status == 2:
            raise ConfigError(self.key, msg)
        return self

    def _acquire(self) -> tuple[int, str]:
        self._created = not self.run_dir.exists()
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.run_dir / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            return 2, f"{str(self.run_dir)!r}: cannot create the run directory ({e.strerror})"
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            return 1, (
                f"run_dir {str(self.run_dir)!r} is in use by another trainer ({holder}); "
                "wait for it to finish or stop it, or use another run_dir"
            )
        os.ftruncate(fd, 0)
        os.write(
            fd,
            json.dumps(
                {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            ).encode(),
        )
        self._fd = fd
        return 0, ""

    def __exit__(self, exc_type, *exc) -> None:
        if self._fd is None:
            return
        if exc_type is not None and self._created:
            # A run that failed before writing anything (e.g. init_from does not fit the
            # model) leaves no directory behind: only the lock and empty directories go.
            (self.run_dir / LOCK_NAME).unlink(missing_ok=True)
            for d in sorted(self.run_dir.rglob("*"), reverse=True) + [self.run_dir]:
                if d.is_dir() and not any(d.iterdir()):
                    d.rmdir()
        os.close(self._fd)  # drops the flock; the file stays (unlinking it would race)
        self._fd = None
