"""`fsdp-jax train` once its flags have parsed: the run config, the processes joined, the trainer's loop
(its flags and description: fsdp_jax.app.cli.train)."""

from __future__ import annotations

from fsdp_jax.app.devices import use_cpu_devices
from fsdp_jax.app.exits import BAD_INPUT
from fsdp_jax.app.trainer import loop
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.errors import ConfigError
from fsdp_jax.multihost.distributed import await_peer_verdict, finished, maybe_initialize
from fsdp_jax.targets.xla_flags import apply_gpu_fsdp_flags

PEER_NOTE = (
    "the newest committed checkpoint is intact (a save in flight never commits without every "
    "process): run the same command again to resume"
)


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
