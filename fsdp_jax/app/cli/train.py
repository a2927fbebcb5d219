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

from fsdp_jax.app.cli.args import add_config
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser
from fsdp_jax.app.devices import use_cpu_devices
from fsdp_jax.app.exits import BAD_INPUT
from fsdp_jax.app.trainer import loop
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.errors import ConfigError, TrainingDiverged
from fsdp_jax.multihost.distributed import await_peer_verdict, finished, maybe_initialize
from fsdp_jax.targets.xla_flags import apply_gpu_fsdp_flags


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(prog=prog, description=__doc__)
    add_config(ap, example="train.steps=20")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    return ap


PEER_NOTE = (
    "the newest committed checkpoint is intact (a save in flight never commits without every "
    "process): run the same command again to resume"
)


def _errors():

    return (), (TrainingDiverged,)


def run(args) -> int:

    use_cpu_devices()
    cfg = load_run_config(args.config, args.overrides)
    if cfg.xla_gpu_flags == "fsdp":  # XLA reads XLA_FLAGS when the backend starts: do it first
        apply_gpu_fsdp_flags()
    d = cfg.distributed
    try:  # before any computation: joins this process to the others, if any
        maybe_initialize(
            d.coordinator,
            d.num_processes,
            d.process_id,
            d.init_timeout_s,
            peer_timeout_s=d.peer_timeout_s,
            peer_note=PEER_NOTE,
        )
    except ValueError as e:
        raise ConfigError("distributed", str(e)) from None
    try:
        loop.train(cfg, progress=not args.no_progress)
    except BAD_INPUT:
        raise
    except Exception:  # divergence, a full disk, a collective reset by a dead peer: in a
        await_peer_verdict()  # multi-process run the peer watch names a dead peer instead
        raise
    finished()
    return 0


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    return run_command(build_parser(prog), run, argv, errors=_errors)
