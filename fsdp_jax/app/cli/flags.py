"""Command-line flags: one parser with the project's error format, and number types
with their ranges, so a bad number is refused by the parser naming the flag.

    ap = Parser(description=...)
    ap.add_argument("--steps", type=int_in(1), default=3)
    ap.add_argument("--max-params", type=real_in(0), default=20e6)

A value outside its range (or not a number, or not finite) ends the parse with one line
on stderr, `error: argument --steps: -5 is invalid; must be an integer >= 1`, and
exit code 2 (`fsdp_jax.app.exits.run_command` turns the parser's SystemExit into the
command's return code).
"""

from __future__ import annotations

import argparse
import math
import sys


class Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line on stderr, exit code 2. The
    description keeps its line breaks (a command's docstring, examples included)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


def _bounds(low, high) -> str:
    if high is None:
        return f">= {low}"
    return f"in {low}..{high}"


def int_in(low: int, high: int | None = None):
    """An argparse `type`: an integer in [low, high] (no upper limit when `high` is None)."""

    def parse(text: str) -> int:
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if v < low or (high is not None and v > high):
            raise argparse.ArgumentTypeError(f"{text} is invalid; must be an integer {_bounds(low, high)}")
        return v

    parse.__name__ = "integer"
    parse.bounds = (low, high)
    return parse


def real_in(low: float, high: float | None = None, *, above: bool = False):
    """An argparse `type`: a finite number in [low, high] (`above`: strictly > low)."""

    def parse(text: str) -> float:
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        bad = not math.isfinite(v) or (v <= low if above else v < low) or (high is not None and v > high)
        if bad:
            lo = f"> {low}" if above else _bounds(low, high)
            if above and high is not None:
                lo = f"in ({low}, {high}]"
            raise argparse.ArgumentTypeError(f"{text} is invalid; must be a finite number {lo}")
        return v

    parse.__name__ = "number"
    parse.bounds = (low, high)
    return parse
