#!/usr/bin/env python
"""Train the reference Llama model with FSDP.

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

import argparse
import os
import sys


class _Parser(argparse.ArgumentParser):
    """argparse with the project's error format: one line on stderr, exit code 2."""

    def error(self, message):
        print(f"error: {message}", file=sys.stderr, flush=True)
        sys.exit(2)


PEER_NOTE = ("the newest committed checkpoint is intact (a save in flight never commits without every "
             "process): run the same command again to resume")


def main(argv: list[str] | None = None) -> int:
    ap = _Parser(description=__doc__.splitlines()[1].strip(),
                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", required=True, help="YAML config (configs/*.yaml)")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    ap.add_argument("overrides", nargs="*", help="dotted key=value overrides, e.g. train.steps=20")
    try:
        args = ap.parse_args(argv)
    except SystemExit as e:  # argparse printed its one-line usage error
        return 2 if e.code else 0

    import jax

    from fsdp_jax.app.cli import BAD_INPUT, ENVIRONMENT, fail, fail_env, fail_internal, use_cpu_devices
    from fsdp_jax.app.config import ConfigError, load_config
    from fsdp_jax.distributed import await_peer_verdict, finished, maybe_initialize
    from fsdp_jax.xla_flags import apply_gpu_fsdp_flags
    from fsdp_jax.app.loop import TrainingDiverged, train

    try:
        use_cpu_devices()
        cache = os.environ.get("FSDP_JAX_CACHE_DIR")
        if cache:
            jax.config.update("jax_compilation_cache_dir", cache)
        cfg = load_config(args.config, args.overrides)
        if cfg.xla_gpu_flags == "fsdp":  # XLA reads XLA_FLAGS when the backend starts: do it first
            apply_gpu_fsdp_flags()
        d = cfg.distributed
        try:  # before any computation: joins this process to the others, if any
            maybe_initialize(d.coordinator, d.num_processes, d.process_id, d.init_timeout_s,
                             peer_timeout_s=d.peer_timeout_s, peer_note=PEER_NOTE)
        except ValueError as e:
            raise ConfigError("distributed", str(e)) from None
        train(cfg, progress=not args.no_progress)
        finished()
    except BAD_INPUT as e:
        return fail(e)
    except (TrainingDiverged, *ENVIRONMENT) as e:
        await_peer_verdict()  # a multi-process run: a dead peer is named by the watch instead
        return fail_env(e)
    except Exception as e:  # out of device memory, a dead peer, or a bug: still one line (exit 1)
        await_peer_verdict()  # e.g. a collective reset by a dead peer: the watch names the peer
        return fail_internal(e)
    return 0


if __name__ == "__main__":
    sys.exit(main())
