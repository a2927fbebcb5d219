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

ENV_COORDINATOR = "FSDP_JAX_COORDINATOR"
ENV_NUM_PROCESSES = "FSDP_JAX_NUM_PROCESSES"
ENV_PROCESS_ID = "FSDP_JAX_PROCESS_ID"


def detected_cluster(environ=os.environ) -> str | None:
    """Name of the multi-process environment JAX can auto-detect, or None."""
    if int(environ.get("SLURM_NTASKS", "1") or 1) > 1 and "SLURM_JOB_ID" in environ:
        return "slurm"
    if int(environ.get("OMPI_COMM_WORLD_SIZE", "1") or 1) > 1:
        return "openmpi"
    if environ.get("JAX_COORDINATOR_ADDRESS"):
        return "jax_coordinator_env"
    return None


def maybe_initialize(coordinator: str | None = None, num_processes: int | None = None,
                     process_id: int | None = None, timeout_s: int = 300,
                     environ=os.environ) -> str:
    """Initialise `jax.distributed` when this run has several processes.

    Returns how: "explicit", the detected cluster's name, or "single" (nothing done).
    Raises ValueError for incomplete explicit settings.
    """
    import jax

    coordinator = coordinator or environ.get(ENV_COORDINATOR)
    if num_processes is None and environ.get(ENV_NUM_PROCESSES):
        num_processes = int(environ[ENV_NUM_PROCESSES])
    if process_id is None and environ.get(ENV_PROCESS_ID):
        process_id = int(environ[ENV_PROCESS_ID])
    if coordinator or num_processes:
        if not (coordinator and num_processes and process_id is not None):
            raise ValueError(
                "distributed: set coordinator, num_processes and process_id together "
                f"(got coordinator={coordinator!r}, num_processes={num_processes!r}, "
                f"process_id={process_id!r})")
        if not 0 <= process_id < num_processes:
            raise ValueError(f"distributed.process_id {process_id}: must be in [0, {num_processes})")
        if num_processes == 1:
            return "single"
        jax.distributed.initialize(coordinator, num_processes, process_id,
                                   initialization_timeout=timeout_s)
        return "explicit"
    cluster = detected_cluster(environ)
    if cluster:
        jax.distributed.initialize(initialization_timeout=timeout_s)
        return cluster
    return "single"
