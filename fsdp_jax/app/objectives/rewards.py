"""GRPO's reward functions, run in worker processes with a timeout.

A reward is TRL's `fn(prompts, completions, **columns) -> list[float]` (None where it does
not apply), named `module:function` (imported in the worker with the run's working directory
on `sys.path`) or by a built-in's short name (`reward_builtins.BUILTINS`), with a `weight`
and keyword `args`. `RewardPool` starts `workers` processes (`reward_worker.py`, run by path:
no jax in them), each loading every function, and splits a batch's rows over them. Requests
and answers are JSON lines (no pickle).

What stops a run, one line naming the function:
- `RewardError` (bad input, exit 2): the module or function is missing (at start, before any
  training), or a function returns the wrong number of values;
- `RewardFailed` (exit 1): a function raises, returns NaN or inf, or a worker does not
  answer within `timeout` seconds (its processes are killed: it never hangs training).
With `on_nan: drop`, a NaN value is kept as "not scored" instead (TRL's None: a row no
function scores gets advantage 0); raising and hanging always stop.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import selectors
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from fsdp_jax.app.objectives.reward_builtins import BUILTINS
from fsdp_jax.errors import RewardError, RewardFailed

WORKER = Path(__file__).with_name("reward_worker.py")
ON_NAN = ("stop", "drop")


@dataclasses.dataclass(frozen=True)
class RewardFn:
    """One reward: `fn` ("module:function" or a built-in name), its `weight` and `args`."""

    fn: str
    weight: float = 1.0
    args: tuple[tuple[str, object], ...] = ()

    def spec(self) -> dict:
        return {"fn": self.fn, "args": dict(self.args)}


def reward_problem(r: RewardFn) -> str | None:
    """Why `r.fn` cannot name a reward (syntax only; the worker imports it), else None."""
    if ":" not in r.fn:
        if r.fn not in BUILTINS:
            return f"{r.fn!r} is neither module:function nor a built-in ({', '.join(sorted(BUILTINS))})"
        return None
    mod, _, name = r.fn.partition(":")
    if not mod or not name.isidentifier():
        return f"{r.fn!r} is not module:function"
    return None


class RewardPool:
    """`with RewardPool(fns, workers=2, timeout=60) as pool: pool.score(prompts, completions,
    columns)` -> (B, F) float32 (NaN: not scored)."""

    def __init__(self, fns: list[RewardFn], workers: int = 1, timeout: float = 60.0, on_nan: str = "stop"):
        self.fns, self.timeout, self.on_nan = list(fns), float(timeout), on_nan
        self.procs: list[subprocess.Popen] = []
        specs = json.dumps([f.spec() for f in self.fns])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]))
        for _ in range(max(1, workers)):
            self.procs.append(
                subprocess.Popen(
                    [sys.executable, str(WORKER), specs],
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    env=env,
                    text=True,
                    bufsize=1,
                )
            )
        try:
            for p in self.procs:
                msg = self._read(p, "(loading)")
                if msg.get("error") == "load":
                    raise RewardError(f"grpo.rewards: {msg['fn']} cannot be loaded: {msg['msg']}")
        except BaseException:
            self.close()
            raise

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdin, p.stdout):
                if f is not None:
                    f.close()
        self.procs = []

    def _read(self, p: subprocess.Popen, what: str) -> dict:
        sel = selectors.DefaultSelector()
        sel.register(p.stdout, selectors.EVENT_READ)
        deadline = time.monotonic() + self.timeout
        try:
            while time.monotonic() < deadline:
                if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    line = p.stdout.readline()
                    if not line:
                        raise RewardFailed(f"grpo.rewards: the reward worker exited (code {p.wait()}) while {what}")
                    return json.loads(line)
        finally:
            sel.close()
        self.close()
        names = ", ".join(f.fn for f in self.fns)
        raise RewardFailed(f"grpo.rewards: no answer within {self.timeout:g} s while {what} ({names}); workers killed")

    def score(self, prompts: list, completions: list, columns: dict | None = None) -> np.ndarray:
        """(B, F) float32 rewards of B completions (NaN where a function returned None)."""
        b, n = len(completions), len(self.procs)
        cuts = np.linspace(0, b, n + 1).astype(int)
        cols = columns or {}
        for p, lo, hi in zip(self.procs, cuts[:-1], cuts[1:]):
            req = {"prompts": prompts[lo:hi], "completions": completions[lo:hi]}
            req["columns"] = {k: list(v)[lo:hi] for k, v in cols.items()}
            p.stdin.write(json.dumps(req) + "\n")
            p.stdin.flush()
        out = np.full((b, len(self.fns)), np.nan, np.float32)
        for p, lo, hi in zip(self.procs, cuts[:-1], cuts[1:]):
            msg = self._read(p, "scoring")
            if msg.get("error") == "raise":
                self.close()
                raise RewardFailed(f"grpo.rewards: {msg['fn']} raised {msg['msg']}")
            for j, (f, vals) in enumerate(zip(self.fns, msg["results"])):
                out[lo:hi, j] = self._checked(f, vals, hi - lo)
        return out

    def _checked(self, f: RewardFn, vals, n: int) -> np.ndarray:
        if vals is None or len(vals) != n:
            got = "None" if vals is None else f"{len(vals)} values"
            self.close()
            raise RewardError(f"grpo.rewards: {f.fn} returned {got} for {n} completions (one float or None each)")
        bad = [v for v in vals if isinstance(v, str)]  # "nan" / "inf" (JSON has neither)
        if bad and (self.on_nan == "stop" or "inf" in bad):
            self.close()
            raise RewardFailed(f"grpo.rewards: {f.fn} returned {bad[0]} (grpo.on_nan: drop keeps NaN as unscored)")
        return np.asarray([math.nan if (v is None or isinstance(v, str)) else v for v in vals], np.float32)
