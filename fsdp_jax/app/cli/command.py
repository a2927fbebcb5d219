"""The one main wrapper of every command: parse, run, map exceptions to exit codes
(`fsdp_jax.app.exits`). Import-light: a command names its body as `"module:function"`
(`fsdp_jax.app.cli.run`), imported only once the flags have parsed, so `--help` and a bad
flag never import JAX: this is the CLI's start-up boundary, with `entry.command_module`."""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

import fsdp_jax
from fsdp_jax.app.exits import BAD_INPUT, ENVIRONMENT, fail, fail_env, fail_internal
from fsdp_jax.app.held_warnings import held
from fsdp_jax.errors import UsageError, one_line
from fsdp_jax.targets.xla_flags import check_xla_flags

Classes = tuple[type[BaseException], ...]
Errors = tuple[Classes, Classes]


def run_command(
    parser: argparse.ArgumentParser,
    body: Callable[[argparse.Namespace], int] | str,
    argv: list[str] | None = None,
    *,
    errors: Callable[[], Errors] | None = None,
    before: Callable[[argparse.Namespace], object] | None = None,
    computes: bool = False,
) -> int:
    """The one main wrapper: parse `argv` with `parser` (a bad flag: its one line, exit 2;
    `--help`: exit 0), then return `body(args)`, mapping what it raises to exit codes:
    `UsageError` -> its line, 2 (as the parser's own errors); `BAD_INPUT` (and the
    command's own bad-input classes) -> one line, 2; `ENVIRONMENT` (and the command's
    own) -> one line, 1; anything else -> `fail_internal`, one line, 1. Python warnings
    the body raises are held (`fsdp_jax.app.held_warnings`): printed once it has started or
    returned, dropped when it fails, so the error line is the only line on stderr.

    `body`: the function, or where it is as `"module:function"`: imported after the flags
    have parsed (an import that fails is not mapped: a broken install shows its traceback),
    after the library's face (`fsdp_jax`: Flax first, without IPython, `fsdp_jax.model.flax_import`);
    a body that loaded JAX and Flax in its own order cost more (a tiny train child +0.5 s CPU).

    `errors`: a function returning the command's extra (bad input, environment) exception
    classes, called only when `body` raises, so a command imports them lazily.

    `before`: the command's checks that need no JAX (its config read field by field:
    `fsdp_jax.app.cli.args.config_before_jax`), run before the face and the body load, with
    the same mapping of what it raises: a refused config costs ~0.1 s of CPU, not ~3 s.

    `computes`: the body starts XLA in this process, so XLA_FLAGS are checked after `before` and
    before the body loads JAX (`fsdp_jax.targets.xla_flags.check_xla_flags`, a ~0.2 s child): an
    entry XLA would abort the process over is one line in ~0.3 s of CPU, not ~2.5 s."""
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # the parser printed its one line (or the help)
        return 2 if e.code else 0
    if before is not None and (refused := _mapped(before, args, errors)) is not None:
        return refused
    if computes and (refused := _mapped(lambda _: check_xla_flags(), args, errors)) is not None:
        return refused
    if isinstance(body, str):  # the start-up boundary: the body's imports (JAX, Flax) load here,
        fsdp_jax.make_mesh  # noqa: B018  the face first, in its order: as `import fsdp_jax` did before it was lazy
        module, name = body.split(":")
        body = getattr(importlib.import_module(module), name)
    return _mapped(body, args, errors)


def _mapped(call: Callable[[argparse.Namespace], object], args: argparse.Namespace, errors) -> int | None:
    """`call(args)`'s return value, or the exit code of what it raised (`run_command`)."""
    try:
        with held():  # warnings wait until the command has started: a refusal is the only line
            return call(args)
    except UsageError as e:  # flags that do not go together: one line, as the parser's
        print(f"error: {one_line(e, None)}", file=sys.stderr, flush=True)
        return 2
    except Exception as e:
        bad, env = errors() if errors is not None else ((), ())
        if isinstance(e, BAD_INPUT + bad):
            return fail(e)
        if isinstance(e, ENVIRONMENT + env):
            return fail_env(e)
        return fail_internal(e)
