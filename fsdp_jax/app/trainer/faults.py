"""Fault injection for tests: steps whose loss is made NaN, a delay on every batch.

Tests pass a `Faults` to `fsdp_jax.app.trainer.loop.train(cfg, faults=...)`; the loop reads
nothing from the environment. The commands' test hook stays: `Faults.from_env()` reads
`FSDP_JAX_INJECT_NAN_STEPS` (comma-separated step numbers, 1-based as logged, e.g.
"5,6,7") and `FSDP_JAX_INJECT_DATA_DELAY_S` (seconds slept after each batch is read);
`train` calls it when no `faults` is given (the subprocess tests' road).
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np

from fsdp_jax.app.trainer.timing import INJECT_DATA_DELAY_ENV, injected_data_delay
from fsdp_jax.errors import ConfigError

INJECT_NAN_ENV = "FSDP_JAX_INJECT_NAN_STEPS"

__all__ = ["Faults", "INJECT_NAN_ENV", "INJECT_DATA_DELAY_ENV"]


def nan_steps_from_text(text: str) -> frozenset[int]:
    """ "5,6,7" -> {5, 6, 7}; ConfigError naming INJECT_NAN_ENV unless step numbers >= 1."""
    try:
        steps = frozenset(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        steps = frozenset({0})
    if any(s < 1 for s in steps):
        raise ConfigError(
            INJECT_NAN_ENV, f"{text!r} is invalid; expected comma-separated step numbers >= 1, e.g. 5,6,7"
        )
    return steps


@dataclasses.dataclass(frozen=True)
class Faults:
    """What to break in a run: `nan_steps` (1-based step numbers whose batch gets an
    out-of-range token in its first position, so `jnp.take` makes the loss NaN) and
    `data_delay_s` (seconds slept after each batch is read, counted as data time)."""

    nan_steps: frozenset[int] = frozenset()
    data_delay_s: float = 0.0

    @classmethod
    def from_env(cls, environ=os.environ) -> "Faults":
        """The commands' test hook (see the module docstring); ConfigError naming the
        variable for a bad value."""
        return cls(nan_steps_from_text(environ.get(INJECT_NAN_ENV, "")), injected_data_delay(environ))

    def poison(self, step: int, local, vocab_size: int):
        """`local` (tokens (B, S + 1), or a batch dict with "inputs"), with token id
        `vocab_size` in column 0 when `step` is one of `nan_steps`; else `local` itself."""
        if step not in self.nan_steps:
            return local
        if isinstance(local, dict):
            inputs = np.array(local["inputs"], copy=True)
            inputs[:, 0] = vocab_size
            return {**local, "inputs": inputs}
        local = np.array(local, copy=True)
        local[:, 0] = vocab_size
        return local
