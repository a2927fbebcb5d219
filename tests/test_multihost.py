"""Several processes, one global mesh: jax.distributed over gloo on localhost."""

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from helpers import TINY_RUN_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = [sys.executable, str(ROOT / "scripts" / "launch.py")]


def launch(*args, timeout=180, env=None):
    return subprocess.run(
        [*LAUNCH, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=dict(os.environ, **(env or {}))
    )


GLOBAL_MESH = textwrap.dedent("""
    import os, jax
    jax.config.update("jax_num_cpu_devices", int(os.environ["FSDP_JAX_CPU_DEVICES"]))
    from fsdp_jax.multihost.distributed import maybe_initialize
    how = maybe_initialize()
    import numpy as np, jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    import fsdp_jax as fj
    mesh = fj.make_mesh(data=2, fsdp=-1)
    rows = [[d.process_index for d in r.flat] for r in mesh.devices]
    local = np.full((4,), jax.process_index() + 1, np.float32)
    x = jax.make_array_from_process_local_data(NamedSharding(mesh, P(("data", "fsdp"))), local)
    print("RESULT", how, jax.process_count(), jax.device_count(), rows, float(jax.jit(jnp.sum)(x)))
""")


@pytest.mark.slow
def test_two_processes_form_one_hybrid_mesh(tmp_path):
    script = tmp_path / "mesh.py"
    script.write_text(GLOBAL_MESH)
    r = launch("--processes", "2", "--devices-per-process", "4", "--", sys.executable, str(script))
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    results = [l for l in r.stdout.splitlines() if "RESULT" in l]
    assert sorted(l[:3] for l in results) == ["[0]", "[1]"]
    for line in results:
        # data axis across processes (DCN), fsdp within a process; sum over all 8 shards
        assert "RESULT explicit 2 8 [[0, 0, 0, 0], [1, 1, 1, 1]] 12.0" in line


@pytest.mark.slow
def test_launcher_fails_fast_when_one_process_dies(tmp_path):
    script = tmp_path / "die.py"
    script.write_text(
        textwrap.dedent("""
        import os, sys, time
        if os.environ["FSDP_JAX_PROCESS_ID"] == "1":
            time.sleep(1)
            os.kill(os.getpid(), 9)
        time.sleep(300)   # process 0 would hang forever waiting for its peer
    """)
    )
    t = time.monotonic()
    r = launch("--processes", "2", "--grace", "5", "--", sys.executable, str(script), timeout=90)
    assert r.returncode != 0
    assert time.monotonic() - t < 60
    assert "process 1 exited with -9" in r.stderr


def test_distributed_settings_must_be_complete():
    from fsdp_jax.multihost.distributed import detected_cluster, maybe_initialize

    with pytest.raises(ValueError, match="set coordinator, num_processes and process_id together"):
        maybe_initialize(coordinator="127.0.0.1:1234", environ={})
    assert maybe_initialize(environ={}) == "single"
    assert detected_cluster({"SLURM_NTASKS": "4", "SLURM_JOB_ID": "1"}) == "slurm"
    assert detected_cluster({"SLURM_NTASKS": "1", "SLURM_JOB_ID": "1"}) is None
    assert detected_cluster({"OMPI_COMM_WORLD_SIZE": "2"}) == "openmpi"


# tests/test_nvme.py's 2-process test launches the tiny run with these
TINY = TINY_RUN_OVERRIDES + ["train.checkpoint_every=0", "train.steps=5"]


def train_args(corpus, run_dir, *extra):
    return [
        "--config",
        "configs/tiny.yaml",
        "--no-progress",
        *TINY,
        f"data.path={corpus}",
        f"run_dir={run_dir}",
        *extra,
    ]


# The 2-process training run against one process (and its checkpoint on 8 and 4 devices of one process):
# tests/test_faults.py's test_two_processes_train_like_one_and_checkpoints_move_between_process_counts,
# which shares that module's 2-process reference run with the fault tests.
