"""Where a run's wall time goes: a step-time breakdown per logged window, a goodput
summary at the end, and the profiler window (`train.profile=START:END`).

`StepTimer` splits one process's wall clock into categories with `switch(name)`:
from that call on, time is charged to `name` until the next switch, so the
categories of a window add up to its wall time exactly, and `other` (the loop's own
bookkeeping, the progress bar) is what no named category claimed. The trainer
charges

    data        the host fetching the next batch and placing it on the devices
                (`next(batches)` + `make_array_from_process_local_data`);
    device      dispatching the step and blocking on its results (`float(loss)`):
                the device time the host could not hide behind its own work;
    checkpoint  the blocking part of an (asynchronous) checkpoint save, and the final
                wait for the writes to commit;
    eval        evaluation, including the eval step's first compile;
    compile     compiling the train step (once, in the first window);
    profile     starting and stopping the profiler trace;
    log         starting the loggers (W&B), computing each record (the first one
                compiles the LR schedule) and writing it (metrics.jsonl, TB, W&B);
    sample      the text sample after training (goodput only);
    other       the rest.

How honest `device` is depends on the run-ahead (`train.max_inflight_steps`). With 1
(the default) the loop blocks on every step before fetching the next batch, so the
devices idle while the host loads data: `data` is a real stall and `device` is the
devices' whole step time. With k > 1 the host fetches and dispatches up to k steps
before blocking, so device work overlaps host work: a step's device time spent while
the host was fetching data is charged to `data`, and `device` is only the part the
host waited for. The categories still add up to the wall time, but `data` is then an
upper bound on the data stall, not a measurement of it, and goodput a lower bound
(a device trace, see `train.profile`, shows the true overlap).

Goodput = device / wall over the whole run, wall counted from before `setup` (model,
state init or checkpoint restore, the run directory and data pipeline: all counted as
`setup`) to the end of training. The first logged window starts when the
train step starts compiling.
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Callable

import jax

from fsdp_jax.app.config.policy_checks import parse_profile
from fsdp_jax.errors import ConfigError

# Test hook: seconds slept after each train batch is fetched (charged to `data`).
INJECT_DATA_DELAY_ENV = "FSDP_JAX_INJECT_DATA_DELAY_S"

# Categories of a logged window, in the order they are reported (`t_<name>_s` columns).
WINDOW = ("data", "device", "checkpoint", "eval", "compile", "profile", "log", "other")
# Categories of the whole run (`total_<name>_s` in the goodput record).
RUN = ("setup",) + WINDOW[:-1] + ("sample", "other")
PRODUCTIVE = "device"


class StepTimer:
    """Charges elapsed wall time to the current category (see the module docstring).

    `window()` returns the `t_<category>_s` columns and `t_wall_s` since the last
    `cut()` (or since construction); `totals()` the seconds per category since
    construction. `category` is the first one charged (the trainer starts in `setup`
    and cuts when it starts compiling, so setup is in the goodput, not in a window);
    `clock` is injectable for tests."""

    def __init__(self, category: str = "other", clock: Callable[[], float] = time.perf_counter):
        self._clock = clock
        self.current = category
        self._t = self._start = self._cut_t = clock()
        self._total = dict.fromkeys(RUN, 0.0)
        self._at_cut = dict(self._total)

    def switch(self, category: str) -> None:
        """Charge the time since the last switch to the current category; then `category`."""
        if category not in self._total:
            raise ValueError(f"unknown timing category {category!r}; one of {', '.join(RUN)}")
        now = self._clock()
        self._total[self.current] += now - self._t
        self._t, self.current = now, category

    def _flush(self) -> float:
        self.switch(self.current)
        return self._t

    def window(self) -> dict[str, float]:
        """Seconds per window category since the last cut, and the window's wall time."""
        now = self._flush()
        out = {f"t_{k}_s": self._total[k] - self._at_cut[k] for k in WINDOW}
        # time charged to run-only categories inside a window (none in the trainer) is "other"
        out["t_other_s"] += sum(self._total[k] - self._at_cut[k] for k in RUN if k not in WINDOW)
        out["t_wall_s"] = now - self._cut_t
        return out

    def cut(self) -> None:
        """Start a new window now."""
        self._cut_t = self._flush()
        self._at_cut = dict(self._total)

    def totals(self) -> dict[str, float]:
        self._flush()
        return dict(self._total)


def goodput(totals: dict[str, float], setup_s: float = 0.0, n_losses: int = 3) -> dict:
    """The goodput record: `goodput` (device / wall), `total_wall_s`, `total_<cat>_s`
    for every category of `RUN`, and `largest_losses`: up to `n_losses` non-productive
    categories, largest first, as (name, seconds, fraction of wall) for those > 0."""
    t = dict(totals, setup=totals.get("setup", 0.0) + setup_s)
    wall = sum(t.values())
    rec = {"goodput": t[PRODUCTIVE] / wall if wall > 0 else 0.0, "total_wall_s": wall}
    rec.update({f"total_{k}_s": t.get(k, 0.0) for k in RUN})
    losses = sorted(((k, v) for k, v in t.items() if k != PRODUCTIVE and v > 0), key=lambda kv: -kv[1])
    rec["largest_losses"] = [(k, v, v / wall) for k, v in losses[:n_losses]]
    return rec


def format_goodput(rec: dict) -> str:
    """One line: goodput, productive and wall seconds, the largest losses named."""
    lost = ", ".join(f"{k} {s:.1f}s ({f:.1%})" for k, s, f in rec["largest_losses"]) or "none"
    return (
        f"goodput {rec['goodput']:.1%} (device step time {rec[f'total_{PRODUCTIVE}_s']:.1f}s "
        f"of {rec['total_wall_s']:.1f}s wall); largest losses: {lost}"
    )


def format_window(rec: dict, min_fraction: float = 0.01) -> str:
    """The window's breakdown for the progress bar, e.g. 'device 81% data 12% eval 5%'
    (categories under `min_fraction` of the window's wall time left out)."""
    wall = rec.get("t_wall_s") or 0.0
    if wall <= 0:
        return "n/a"
    parts = [(k, rec.get(f"t_{k}_s", 0.0) / wall) for k in WINDOW]
    return " ".join(f"{k} {f:.0%}" for k, f in parts if f >= min_fraction)


def injected_data_delay(environ=os.environ) -> float:
    """Seconds of `FSDP_JAX_INJECT_DATA_DELAY_S` (0 when unset); ConfigError unless a
    finite number >= 0."""
    text = environ.get(INJECT_DATA_DELAY_ENV, "").strip()
    if not text:
        return 0.0
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value >= 0):
        raise ConfigError(INJECT_DATA_DELAY_ENV, f"{text!r} is invalid; must be seconds >= 0")
    return value


class ProfileWindow:
    """Traces steps START..END (1-based, inclusive) of `train.profile` with
    `jax.profiler` into `log_dir` (TensorBoard's `plugins/profile/<time>/` layout:
    `<host>.xplane.pb` for TensorBoard's profile plugin, and `<host>.trace.json.gz`, a
    Chrome trace-event file that the Perfetto UI opens).

    The loop calls `step_begin(step)` before fetching a step's batch and
    `step_end(step, pending)` after draining; at END the steps still in flight are
    waited for (charged to `device`) so the trace holds END's execution. A run resumed
    inside the window traces from its first step; one resumed past it traces nothing."""

    def __init__(self, spec: str | None, log_dir: Path, timer: StepTimer, announce: bool):
        rng = parse_profile(spec) if spec else None
        self.start, self.end = rng if rng else (0, -1)
        self.log_dir, self.timer, self.announce = log_dir, timer, announce
        self.active, self.first = False, None

    def step_begin(self, step: int) -> None:
        if not self.active and self.first is None and self.start <= step <= self.end:
            before = self.timer.current
            self.timer.switch("profile")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            jax.profiler.start_trace(str(self.log_dir))
            self.active, self.first = True, step
            self.timer.switch(before)

    def step_end(self, step: int, pending) -> None:
        if self.active and step >= self.end:
            self.close(step, pending)

    def close(self, step: int | None = None, pending=()) -> None:
        """Stop the trace (if running) after the steps in `pending` finish."""
        if not self.active:
            return
        before = self.timer.current
        if pending:
            self.timer.switch("device")
            jax.block_until_ready([m for _, m in pending])
        self.timer.switch("profile")
        jax.profiler.stop_trace()
        self.active = False
        self.timer.switch(before)
        if self.announce:
            print(self.describe(self.first, step if step is not None else self.end), flush=True)

    def trace_files(self) -> list[Path]:
        return sorted(self.log_dir.glob("plugins/profile/*/*.xplane.pb"))

    def describe(self, first: int, last: int) -> str:
        perfetto = sorted(self.log_dir.glob("plugins/profile/*/*.trace.json.gz"))
        how = f"tensorboard --logdir {self.log_dir}  (needs tensorboard-plugin-profile)"
        if perfetto:
            how += f", or load {perfetto[-1]} in the Perfetto UI (ui.perfetto.dev)"
        return f"profile: steps {first}-{last} traced to {self.log_dir}; view with: {how}"
