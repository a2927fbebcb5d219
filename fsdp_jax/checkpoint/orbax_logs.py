"""Orbax's noise after a failed save, quieted: the Checkpointer reports the failure
once, as one line (`CheckpointWriteError`), so the tracebacks orbax's threads, asyncio
and tensorstore's callbacks would print about the same failure are dropped, and the
threads orbax leaves waiting are released so the process can exit.

`install()` is idempotent; `release_stranded_waits()` runs once per failed save.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import warnings


class _OrbaxErrorsRaised(logging.Filter):
    """Drops orbax's ERROR records that carry a traceback: the same exception is
    re-raised to the Checkpointer's caller, which reports it as one line (a failed
    save otherwise prints one traceback per background thread)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not (
            record.levelno >= logging.ERROR
            and "orbax" in record.pathname
            and (
                record.exc_info
                or "raised an exception" in record.getMessage()
                or "failed" in record.getMessage().lower()
            )
        )


_ORBAX_FILTER = _OrbaxErrorsRaised()


class _UnretrievedOrbaxWrites(logging.Filter):
    """asyncio's "exception was never retrieved" records for orbax's write tasks after a
    failed save: the save's own error is raised (and reported once) by `check`/`wait`,
    so these would only repeat it as tracebacks."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        return not ("exception was never retrieved" in msg and "orbax" in msg)


_ASYNCIO_FILTER = _UnretrievedOrbaxWrites()


def install() -> None:
    """Add the filters above to absl's and asyncio's loggers and the unraisable-exception
    hook (each once; safe to call for every Checkpointer)."""
    logging.getLogger("absl").addFilter(_ORBAX_FILTER)  # idempotent
    logging.getLogger("asyncio").addFilter(_ASYNCIO_FILTER)
    _quiet_closed_loop_callbacks()


def _quiet_closed_loop_callbacks() -> None:
    """After a failed save orbax closes its event loop while tensorstore still completes
    the other writes; each completion's callback then raises 'Event loop is closed',
    which Python prints as an unraisable traceback (dozens per failed save). Drop those,
    pass every other unraisable exception to the previous hook. Installed once."""
    previous = sys.unraisablehook
    if getattr(previous, "_fsdp_jax", False):
        return

    def hook(u):
        if not (isinstance(u.exc_value, RuntimeError) and str(u.exc_value) == "Event loop is closed"):
            previous(u)

    hook._fsdp_jax = True
    sys.unraisablehook = hook


def release_stranded_waits() -> int:
    """After a failed save: wake orbax's save threads still waiting for a signal the
    failed step will never send (e.g. "directory created", when creating the step's
    directory failed) and cancel them. Left alone they block for orbax's coordination
    timeout (300 s), and the process cannot exit meanwhile (they are not daemons).
    Returns how many were released; 0 when this orbax keeps no such threads."""
    try:
        import threading

        from orbax.checkpoint._src.futures import future as _future

        kind = _future._SignalingThread
    except (ImportError, AttributeError):
        return 0
    released = 0
    # their save coroutines, created and now never run, would each warn at exit
    warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
    for t in threading.enumerate():
        if isinstance(t, kind) and t.is_alive():
            with contextlib.suppress(Exception):
                t.cancel()  # checked once the wait ends: the thread returns without running
                _future.set_signals(t._receive_signals, operation_id=t._operation_id)
                released += 1
    return released
