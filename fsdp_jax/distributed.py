"""Multi-process start-up with JAX's own multi-controller runtime (`jax.distributed`).

`maybe_initialize` decides, before any JAX computation:
* explicit settings (arguments, or the FSDP_JAX_COORDINATOR / FSDP_JAX_NUM_PROCESSES /
  FSDP_JAX_PROCESS_ID variables that `scripts/launch_local.py` sets) -> initialise with them;
* a detected cluster (SLURM with more than one task, Open MPI with more than one
  rank, JAX_COORDINATOR_ADDRESS set) -> `jax.distributed.initialize()` auto-detects;
* otherwise one process: nothing is initialised.
On CPU the collectives between processes run over gloo (JAX's CPU default).
"""

from __future__ import annotations

import os
from fsdp_jax.errors import DistributedInitError, one_line  # noqa: F401 (re-exported)

ENV_COORDINATOR = "FSDP_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "FSDP_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "FSDP_JAX_PROCESS_ID"


def _env_int(environ, name: str, low: int = 0) -> int | None:
    """An integer environment variable (None when unset or empty); ValueError naming it."""
    text = environ.get(name, "").strip()
    if not text:
        return None
    try:
        v = int(text)
    except ValueError:
        v = low - 1
    if v < low:
        raise ValueError(f"{name}={environ[name]!r} is invalid; expected an integer >= {low}")
    return v


def detected_cluster(environ=os.environ) -> str | None:
    """Name of the multi-process environment JAX can auto-detect, or None."""
    if (_env_int(environ, "SLURM_NTASKS", 1) or 1) > 1 and "SLURM_JOB_ID" in environ:
        return "slurm"
    if (_env_int(environ, "OMPI_COMM_WORLD_SIZE", 1) or 1) > 1:
        return "openmpi"
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "jax_coordinator_env"
    return None


def is_loopback(host: str) -> bool:
    """True for localhost, 127.0.0.0/8 and ::1 (with or without IPv6 brackets)."""
    import ipaddress
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
    single-machine job, e.g. scripts/launch_local.py) binds that loopback address
    only; otherwise JAX_COORDINATOR_BIND_ADDRESS, when set, or JAX's default (None)."""
    host, _, port = coordinator.rpartition(":")
    if is_loopback(host):
        return f"{host}:{port}"
    return environ.get("JAX_COORDINATOR_BIND_ADDRESS") or None


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, timeout_s: int = 300,
                     environ=os.environ) -> str:
    """Initialise `jax.distributed` when this run has several processes.

    Returns how: "explicit", the detected cluster's name, or "single" (nothing done).
    Raises ValueError (one line naming the setting or variable) for incomplete or bad
    explicit settings, DistributedInitError when joining the other processes fails.
    """
    import jax

    coordinator = coordinator or environ.get(ENV_COORDINATOR) or None
    if num_processes is None:
        num_processes = _env_int(environ, ENV_NUM_PROCESSES, 1)
    if process_id is None:
        process_id = _env_int(environ, ENV_PROCESS_ID, 0)
    if coordinator or num_processes:
        if not (coordinator and num_processes and process_id is not None):
            raise ValueError(
                "set coordinator, num_processes and process_id together "
                f"(got coordinator={coordinator!r}, num_processes={num_processes!r}, "
                f"process_id={process_id!r})")
        host, sep, port = coordinator.rpartition(":")
        if not (sep and host.strip("[]") and port.isdigit() and 0 < int(port) < 65536):
            raise ValueError(f"coordinator {coordinator!r} is invalid; expected HOST:PORT with a "
                             "port in 1..65535")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"process_id {process_id} is invalid; must be in [0, {num_processes})")
        if num_processes == 1:
            return "single"
        if process_id != 0:
            _wait_for_coordinator(coordinator, timeout_s)
        _initialize(jax, coordinator_address=coordinator, num_processes=num_processes,
                    process_id=process_id, initialization_timeout=timeout_s,
                    coordinator_bind_address=bind_address(coordinator, environ))
        return "explicit"
    cluster = detected_cluster(environ)
    if cluster:
        _initialize(jax, initialization_timeout=timeout_s)
        return cluster
    return "single"


def _wait_for_coordinator(coordinator: str, timeout_s: float) -> None:
    """Connect to the coordinator's port until it answers (process 0 may start later).
    JAX's client aborts the whole process (SIGABRT, a C++ stack trace) when it cannot
    register, so an unreachable coordinator is reported here first, as one line."""
    import socket
    import time
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
                    f"({e.strerror or e}); check that process 0 runs and the address is right") from None
        time.sleep(0.5)


def _initialize(jax, **kwargs) -> None:
    import inspect
    bind = kwargs.get("coordinator_bind_address")
    if "coordinator_bind_address" in kwargs and (
            "coordinator_bind_address" not in inspect.signature(jax.distributed.initialize).parameters):
        del kwargs["coordinator_bind_address"]  # a JAX without the argument reads the variable
        if bind:
            os.environ["JAX_COORDINATOR_BIND_ADDRESS"] = bind
    try:
        jax.distributed.initialize(**kwargs)
    except (RuntimeError, ValueError, OSError) as e:  # XlaRuntimeError is a RuntimeError
        raise DistributedInitError(
            f"jax.distributed.initialize failed ({one_line(e, 300)}); check that every process "
            f"started and can reach the coordinator {kwargs.get('coordinator_address') or ''}".rstrip()
        ) from None
