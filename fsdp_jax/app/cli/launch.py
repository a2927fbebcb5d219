"""Start P local processes of one command as a jax.distributed job (CPU, gloo).

    fsdp-jax launch --processes 2 --devices-per-process 4 -- \\
        fsdp-jax train --config configs/tiny.yaml
    python scripts/launch.py --processes 2 --devices-per-process 4 -- \\
        python scripts/train.py --config configs/tiny.yaml

Each process gets FSDP_JAX_COORDINATOR (a free localhost port; the coordinator
service listens on 127.0.0.1 only), FSDP_JAX_NUM_PROCESSES, FSDP_JAX_PROCESS_ID and
FSDP_JAX_CPU_DEVICES; its output lines are prefixed with
`[i]`. Fails fast: when one process exits non-zero or dies (kill -9, out of memory) the
launcher says which in one line on stderr, the others are stopped (SIGTERM, then SIGKILL
after --grace seconds: a survivor blocked in a collective with the dead peer cannot act
on SIGTERM) and the launcher exits with that code (1 for a process killed by a signal).
A trainer's committed checkpoints are untouched: run the same command again to resume.
SIGINT/SIGTERM to the launcher are forwarded to every process. Exit codes: the first
failed process's, 2 bad input (one line on stderr), 0 when every process succeeded.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

from fsdp_jax.app.cli.command import run_command
from fsdp_jax.app.cli.flags import Parser, int_in, real_in
from fsdp_jax.errors import UsageError

MAX_PROCESSES = 1024


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _pump(i: int, stream, out, lock: threading.Lock) -> None:
    for line in iter(stream.readline, ""):
        with lock:
            out.write(f"[{i}] {line}" if line.endswith("\n") else f"[{i}] {line}\n")
            out.flush()
    stream.close()


def stop_all(procs: list[subprocess.Popen], grace: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def build_parser(prog: str | None = None) -> Parser:
    ap = Parser(
        prog=prog,
        description=__doc__,
        usage="%(prog)s [-h] --processes P [--devices-per-process N] [--port PORT] [--grace S] -- COMMAND ...",
    )
    ap.add_argument("--processes", type=int_in(1, MAX_PROCESSES), required=True)
    ap.add_argument("--devices-per-process", type=int_in(1, 1 << 16), default=4)
    ap.add_argument("--port", type=int_in(0, 65535), default=0, help="coordinator port (default: a free one)")
    ap.add_argument("--grace", type=real_in(0, 3600), default=10.0, help="seconds between SIGTERM and SIGKILL")
    return ap


def run(args, command: list[str]) -> int:
    if not command:
        raise UsageError("no command: put it after `--`")
    port = args.port or free_port()
    lock = threading.Lock()
    procs: list[subprocess.Popen] = []
    pumps = []
    for i in range(args.processes):
        # The coordinator (process 0) listens on loopback only: JAX's default is every
        # interface, an unauthenticated service. fsdp_jax.multihost.distributed binds a loopback
        # coordinator address there; JAX_COORDINATOR_BIND_ADDRESS does the same for a
        # command that calls jax.distributed.initialize itself.
        env = dict(
            os.environ,
            FSDP_JAX_COORDINATOR=f"127.0.0.1:{port}",
            JAX_COORDINATOR_BIND_ADDRESS=f"127.0.0.1:{port}",
            FSDP_JAX_NUM_PROCESSES=str(args.processes),
            FSDP_JAX_PROCESS_ID=str(i),
            FSDP_JAX_CPU_DEVICES=str(args.devices_per_process),
            JAX_PLATFORMS="cpu",
            PYTHONUNBUFFERED="1",
        )
        try:
            p = subprocess.Popen(
                command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
            )
        except OSError as e:
            stop_all(procs, args.grace)
            raise UsageError(f"cannot start {command[0]!r}: {e.strerror}") from None
        procs.append(p)
        t = threading.Thread(target=_pump, args=(i, p.stdout, sys.stdout, lock), daemon=True)
        t.start()
        pumps.append(t)

    def forward(signum, _frame):
        for p in procs:
            if p.poll() is None:
                p.send_signal(signum)

    signal.signal(signal.SIGINT, forward)
    signal.signal(signal.SIGTERM, forward)

    rc = 0
    while True:
        codes = [p.poll() for p in procs]
        failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
        if failed:
            i, rc = failed[0]
            how = (
                f" (killed by {signal.Signals(-rc).name}: the others cannot finish a step without it)"
                if rc < 0 and -rc in signal.valid_signals()
                else ""
            )
            with lock:
                print(
                    f"error: launch: process {i} exited with {rc}{how}; stopping the other "
                    f"{len(procs) - 1} (SIGTERM, SIGKILL after {args.grace:g} s)",
                    file=sys.stderr,
                    flush=True,
                )
            stop_all(procs, args.grace)
            break
        if all(c == 0 for c in codes):
            break
        time.sleep(0.2)
    for t in pumps:
        t.join(timeout=5)
    return rc if rc > 0 else (1 if rc else 0)


def main(argv: list[str] | None = None, prog: str | None = None) -> int:

    argv = sys.argv[1:] if argv is None else list(argv)
    command: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, command = argv[:i], argv[i + 1 :]
    return run_command(build_parser(prog), lambda args: run(args, command), argv)
