"""What two schedulers tell a process about its job, as explicit `jax.distributed` settings.

`fsdp_jax.multihost.distributed.maybe_initialize` leaves SLURM, Open MPI and `JAX_COORDINATOR_ADDRESS`
to `jax.distributed.initialize()`'s own detection. Two environments it cannot detect here:

* A Kubernetes Indexed Job (or a JobSet's jobs): the manifest sets FSDP_JAX_COORDINATOR (the
  headless Service name of the pod with index 0, e.g. `train-0.train:1234`) and
  FSDP_JAX_NUM_PROCESSES (the completions); the Job controller gives each pod its index as
  JOB_COMPLETION_INDEX, which is the process id when FSDP_JAX_PROCESS_ID is not set
  (`completion_index`). JAX's own Kubernetes detection needs the `kubernetes` package and
  API access from the pod; this needs neither.
* A multi-host TPU slice on GKE (a JobSet on a TPU node pool): GKE gives each pod
  TPU_WORKER_HOSTNAMES (the slice's hosts, in worker order) and TPU_WORKER_ID, and, for
  several slices, MEGASCALE_COORDINATOR_ADDRESS, MEGASCALE_NUM_SLICES and MEGASCALE_SLICE_ID.
  `gke_tpu_settings` reads them as JAX's GkeTpuCluster does (coordinator: the megascale
  coordinator or the first host, at JAX_COORDINATOR_PORT or 8476; processes: hosts x slices;
  id: worker id + slice id x hosts), which JAX itself switches on only on a TPU VM, so the
  same job also starts where JAX does not look (and on CPU, where the tests start it).
"""

from __future__ import annotations

import os

TPU_COORDINATOR_PORT = 8476  # JAX's default coordinator port on TPU (jax._src.clusters.cloud_tpu_cluster)


def env_int(environ, name: str, low: int = 0) -> int | None:
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


def completion_index(environ=os.environ) -> int | None:
    """A Kubernetes Indexed Job pod's index (JOB_COMPLETION_INDEX), or None."""
    return env_int(environ, "JOB_COMPLETION_INDEX")


def gke_tpu_settings(environ=os.environ) -> tuple[str, int, int] | None:
    """(coordinator, num_processes, process_id) of a multi-host TPU job on GKE, or None when
    TPU_WORKER_HOSTNAMES names fewer than two processes. ValueError names a bad variable."""
    hosts = [h.strip() for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",") if h.strip()]
    slices = env_int(environ, "MEGASCALE_NUM_SLICES", 1) or 1
    if not hosts or len(hosts) * slices < 2:
        return None
    worker = env_int(environ, "TPU_WORKER_ID")
    if worker is None or worker >= len(hosts):
        raise ValueError(
            f"TPU_WORKER_ID={environ.get('TPU_WORKER_ID')!r} is invalid; expected an integer in "
            f"[0, {len(hosts)}) (TPU_WORKER_HOSTNAMES names {len(hosts)} hosts)"
        )
    slice_id = env_int(environ, "MEGASCALE_SLICE_ID") or 0
    if slice_id >= slices:
        raise ValueError(f"MEGASCALE_SLICE_ID={slice_id} is invalid; expected an integer in [0, {slices})")
    host = (environ.get("MEGASCALE_COORDINATOR_ADDRESS") or hosts[0]).split(":")[0]
    port = env_int(environ, "JAX_COORDINATOR_PORT", 1) or TPU_COORDINATOR_PORT
    return f"{host}:{port}", len(hosts) * slices, worker + slice_id * len(hosts)
