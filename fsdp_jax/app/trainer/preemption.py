"""Preemption: SIGTERM / SIGINT end a training run cleanly at a step boundary.

    with StopSignals() as signals:
        for step in ...:
            ...
            if signals.requested():   # every process agrees on the same step
                checkpoint(); break

The first signal only sets a flag (the loop finishes its step, checkpoints and
returns normally); a second one exits at once with status 128 + signum, as a shell
reports a process killed by that signal.
"""

from __future__ import annotations

import os
import signal
import threading

import jax
import numpy as np
from jax.experimental import multihost_utils


class StopSignals:
    """SIGTERM / SIGINT ask the loop to stop after the current step (it checkpoints and
    returns normally); a second signal exits at once. Handlers are installed only in
    the main thread and restored on exit."""

    SIGNALS = (signal.SIGTERM, signal.SIGINT)

    def __init__(self):
        self.signum: int | None = None
        self._old: dict = {}

    def __enter__(self) -> "StopSignals":
        if threading.current_thread() is threading.main_thread():
            self._old = {s: signal.signal(s, self._handle) for s in self.SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, h in self._old.items():
            signal.signal(s, h)

    def _handle(self, signum, frame) -> None:
        if self.signum is not None:
            os.write(2, f"\n{signal.Signals(signum).name} again: exiting now\n".encode())
            os._exit(128 + signum)
        self.signum = signum
        os.write(
            2,
            f"\n{signal.Signals(signum).name}: finishing this step, then checkpointing and "
            "exiting (send it again to exit now)\n".encode(),
        )

    @property
    def name(self) -> str | None:
        """The first signal's name ("SIGTERM"), or None when none arrived here."""
        return None if self.signum is None else signal.Signals(self.signum).name

    def requested(self) -> bool:
        """Whether any process got a signal (all processes agree, so all stop at one step).
        Multi-process: a collective, so every process must call it at every step."""
        flag = self.signum is not None
        if jax.process_count() > 1:
            flag = bool(np.max(multihost_utils.process_allgather(np.int32(flag))))
        return flag
