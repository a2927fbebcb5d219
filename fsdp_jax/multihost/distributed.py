"""Multi-process start-up with JAX's own multi-controller runtime (`jax.distributed`).

`maybe_initialize` decides, before any JAX computation:
* explicit settings (arguments, or the FSDP_JAX_COORDINATOR / FSDP_JAX_NUM_PROCESSES /
  FSDP_JAX_PROCESS_ID variables that `scripts/launch.py` and the Kubernetes recipe
  set; in a Kubernetes Indexed Job the process id defaults to the pod's JOB_COMPLETION_INDEX)
  -> initialise with them;
* a multi-host TPU slice on GKE (TPU_WORKER_HOSTNAMES, TPU_WORKER_ID: `fsdp_jax.multihost.clusters`)
  -> initialise with what GKE says;
* a detected cluster (SLURM with more than one task, Open MPI with more than one
  rank, JAX_COORDINATOR_ADDRESS set) -> `jax.distributed.initialize()` auto-detects;
* otherwise one process: nothing is initialised.
On CPU the collectives between processes run over gloo (JAX's CPU default).
With `peer_timeout_s`, a `fsdp_jax.multihost.peer_watch.PeerWatch` thread stops this process in
one line (exit 1) when a peer stops responding; call `finished()` at a normal end.
"""

from __future__ import annotations

import contextlib
import inspect
import ipaddress
import os
import socket
import time

import jax
from jax._src import distributed as jax_distributed

from fsdp_jax.errors import DistributedInitError, one_line
from fsdp_jax.multihost import clusters, coordination, peer_watch
from fsdp_jax.multihost.clusters import env_int
from fsdp_jax.multihost.peer_watch import PeerWatch

ENV_COORDINATOR = "FSDP_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "FSDP_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "FSDP_JAX_PROCESS_ID"


def detected_cluster(environ=os.environ) -> str | None:
    """Name of the multi-process environment JAX can auto-detect, or None."""
    if (env_int(environ, "SLURM_NTASKS", 1) or 1) > 1 and "SLURM_JOB_ID" in environ:
        return "slurm"
    if (env_int(environ, "OMPI_COMM_WORLD_SIZE", 1) or 1) > 1:
        return "openmpi"
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "jax_coordinator_env"
    return None


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (with or without IPv6 brackets)."""

    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return False
    return ip.is_loopback or bool(getattr(ip, "ipv4_mapped", None) and ip.ipv4_mapped.is_loopback)


def bind_address(coordinator: str, environ=os.environ) -> str | None:
    """Where process 0's coordinator service listens. JAX's default is every interface
    (`[::]:port`): an unauthenticated service. A loopback coordinator address (a
    single-machine job, e.g. scripts/launch.py) binds that loopback address
    only; otherwise JAX_COORDINATOR_BIND_ADDRESS, when set, or JAX's default (None)."""
    host, _, port = coordinator.rpartition(":")
    if is_loopback(host):
        return f"{host}:{port}"
    return environ.get("JAX_COORDINATOR_BIND_ADDRESS") or None


def maybe_initialize(
    coordinator: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    timeout_s: int = 300,
    environ=os.environ,
    peer_timeout_s: float | None = None,
    peer_note: str = "",
) -> str:
    """Initialise `jax.distributed` when this run has several processes.

    Returns how: "explicit", "gke_tpu", the detected cluster's name, or "single" (nothing done).
    Raises ValueError (one line naming the setting or variable) for incomplete or bad
    explicit settings, DistributedInitError when joining the other processes fails.
    `peer_timeout_s` (> 0) starts a PeerWatch once joined (JAX's own heartbeat timeout is
    raised past it); `peer_note` ends the line it prints.
    """

    coordinator = coordinator or environ.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = env_int(environ, ENV_NUM_PROCESSES, 1)
    if process_id is None:
        process_id = env_int(environ, ENV_PROCESS_ID, 0)
    how = "explicit"
    if not (coordinator or num_processes) and (tpu := clusters.gke_tpu_settings(environ)):
        (coordinator, num_processes, process_id), how = tpu, "gke_tpu"
    if (coordinator or num_processes) and process_id is None:
        process_id = clusters.completion_index(environ)  # a Kubernetes Indexed Job's pod
    if coordinator or num_processes:
        if not (coordinator and num_processes and process_id is not None):
            raise ValueError(
                "set coordinator, num_processes and process_id together "
                f"(got coordinator={coordinator!r}, num_processes={num_processes!r}, "
                f"process_id={process_id!r})"
            )
        host, sep, port = coordinator.rpartition(":")
        if not (sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"coordinator {coordinator!r} is invalid; expected HOST:PORT with a port in 1..65535")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id {process_id} is invalid; must be in [0, {num_processes})")
        if num_processes == 1:
            return "single"
        if process_id != 0:
            _wait_for_coordinator(coordinator, timeout_s)
        _initialize(
            jax,
            coordinator_address=coordinator,
            num_processes=num_processes,
            process_id=process_id,
            initialization_timeout=timeout_s,
            coordinator_bind_address=bind_address(coordinator, environ),
            peer_timeout_s=peer_timeout_s,
        )
        _watch_peers(peer_timeout_s, peer_note)
        return how
    cluster = detected_cluster(environ)
    if cluster:
        _initialize(jax, initialization_timeout=timeout_s, peer_timeout_s=peer_timeout_s)
        _watch_peers(peer_timeout_s, peer_note)
        return cluster
    return "single"


_WATCH = None


def _watch_peers(peer_timeout_s: float | None, note: str) -> None:
    global _WATCH
    if not peer_timeout_s:
        return

    state = jax_distributed.global_state
    if state.client is None or state.num_processes < 2:
        return
    _WATCH = PeerWatch(state.client, state.process_id, state.num_processes, peer_timeout_s, note).start()


def await_peer_verdict() -> None:
    """Before reporting an error from a step of a multi-process run: give the peer watch
    (if any) its time to find a dead peer, which it then names in its own line (exit 1).
    Returns at once without a watch, or when every peer still answers."""
    if _WATCH is not None:
        _WATCH.await_verdict()


def finished() -> None:
    """This process ends normally: stop its peer watch (the others stop waiting for it)."""
    global _WATCH

    coordination.finished()
    if _WATCH is not None:
        _WATCH.finish()
        _WATCH = None


def _wait_for_coordinator(coordinator: str, timeout_s: float) -> None:
    """Connect to the coordinator's port until it answers (process 0 may start later).
    JAX's client aborts the whole process (SIGABRT, a C++ stack trace) when it cannot
    register, so an unreachable coordinator is reported here first, as one line."""

    host, _, port = coordinator.rpartition(":")
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with socket.create_connection((host.strip("[]"), int(port)), timeout=2):
                return
        except OSError as e:
            if time.monotonic() >= deadline:
                raise DistributedInitError(
                    f"the coordinator {coordinator} did not answer within {timeout_s} s "
                    f"({e.strerror or e}); check that process 0 runs and the address is right"
                ) from None
        time.sleep(0.5)


def _initialize(jax, peer_timeout_s: float | None = None, **kwargs) -> None:
    """jax.distributed.initialize(**kwargs); with a peer watch, JAX's heartbeat timeout
    is raised past it and process 0's coordination service runs in a child process (so
    that process 0's death does not abort the others: fsdp_jax.multihost.coordination)."""

    bind = kwargs.get("coordinator_bind_address")
    if "coordinator_bind_address" in kwargs and (
        "coordinator_bind_address" not in inspect.signature(jax.distributed.initialize).parameters
    ):
        del kwargs["coordinator_bind_address"]  # a JAX without the argument reads the variable
        if bind:
            os.environ["JAX_COORDINATOR_BIND_ADDRESS"] = bind
    outside = contextlib.nullcontext()
    if peer_timeout_s:
        kwargs["heartbeat_timeout_seconds"] = peer_watch.jax_heartbeat_for(peer_timeout_s)
        outside = coordination.service_outside(linger_s=2 * peer_timeout_s + 10)
    try:
        with outside:
            jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError, OSError) as e:  # XlaRuntimeError is a RuntimeError
        raise DistributedInitError(
            f"jax.distributed.initialize failed ({one_line(e, 300)}); check that every process "
            f"started and can reach the coordinator {kwargs.get('coordinator_address') or ''}".rstrip()
        ) from None
