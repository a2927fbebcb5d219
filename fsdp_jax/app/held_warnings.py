"""Warnings held until a command has started, so that a refusal is the only line on stderr.

The exit-code contract (`fsdp_jax.app.exits`) promises one `error: ...` line for bad input.
Python warnings raised while a command checks its input and builds its plan (a
`ReplicatedWarning` from the sharding check, say) would otherwise be printed before that
line. `run_command` runs every command's body inside `held()`: warnings are kept, in order,
instead of printed; `release()` (the trainer calls it once its run is set up: from then on
a failure is no longer a refusal of the input) prints those kept and lets later ones
through as they come; a body that returns prints what is still held; a body that raises
drops it (its error line is what the user needs).

Only the `warnings` module is held: text a library writes to stderr itself (absl logs,
XLA's) is not.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from collections.abc import Iterator

_HELD: list[list[tuple]] = []  # one list per active `held()` block (innermost last)


def _print(message, category, filename, lineno, file=None, line=None) -> None:
    """Print one warning as Python's default `showwarning` does, to the current stderr."""
    text = warnings.formatwarning(message, category, filename, lineno, line)
    (file or sys.stderr).write(text)


def _hold(message, category, filename, lineno, file=None, line=None) -> None:
    _HELD[-1].append((message, category, filename, lineno, file, line))


@contextlib.contextmanager
def held() -> Iterator[None]:
    """Hold warnings within the block: printed at `release()` or when the block ends
    normally, dropped when it raises."""
    # only `showwarning` is restored on the way out, not the filters: a filter the command
    # installs stays (the checkpointer's, for the save coroutines a failed save leaves to warn
    # at exit), as `warnings.catch_warnings` would not let it
    previous = warnings.showwarning
    warnings.showwarning = _hold
    _HELD.append([])
    try:
        yield
    except BaseException:
        _HELD[-1].clear()
        raise
    finally:
        warnings.showwarning = previous
        kept = _HELD.pop()
        for w in kept:
            _print(*w)


def release() -> None:
    """Print the warnings held so far and let later ones through; a no-op outside `held()`."""
    if not _HELD or warnings.showwarning is not _hold:
        return
    kept, _HELD[-1][:] = list(_HELD[-1]), []
    warnings.showwarning = _print
    for w in kept:
        _print(*w)
