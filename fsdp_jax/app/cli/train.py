"""Train the reference decoder with FSDP.

    fsdp-jax train --config configs/tiny.yaml [key=value ...]
    python scripts/train.py --config configs/tiny.yaml [key=value ...]

On CPU the process gets 8 host devices (FSDP_JAX_CPU_DEVICES to change). Running the
same command again resumes from <run_dir>/checkpoints. Exit codes: 0 success (also
after SIGTERM/SIGINT: the step finishes and a checkpoint is written), 2 bad input
(one line on stderr naming the problem, e.g. a checkpoint that does not fit the
model), 1 anything else (e.g. train.max_nonfinite_steps non-finite steps in a row, a
full disk, a run_dir another trainer holds), always as one line; FSDP_JAX_TRACEBACK=1
shows the traceback of an unexpected error.
"""

from __future__ import annotations

from fsdp_jax.app.cli.args import add_config, config_agrees_before_jax
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser
from fsdp_jax.errors import TrainingDiverged


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, example="train.steps=20")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return ap


def _errors():

    return (), (TrainingDiverged,)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(
        build_parser(prog),
        "fsdp_jax.app.cli.run.train:run",
        argv,
        errors=_errors,
        before=config_agrees_before_jax,
        computes=True,
    )
