"""The cluster recipes of examples/cluster/, each started on this machine the way its scheduler
starts it: 2 local processes (4 CPU devices each) with exactly the variables the scheduler
gives them and the recipe's own command, arguments and environment; they train with the
losses of one process on 8 devices. Addresses the scheduler's DNS would resolve (a node, a
Service, a TPU host) stand for this machine; the coordinator port is a free one."""

import json
import os
import random
import re
import shlex
import socket
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import yaml

from helpers import TINY_RUN_OVERRIDES, call

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "examples" / "cluster"
TINY = [*TINY_RUN_OVERRIDES, "train.checkpoint_every=0", "train.steps=3"]


def free_port(low: int = 20000, high: int = 60000) -> int:
    for _ in range(200):
        port = random.randint(low, high)
        with socket.socket() as s:
            try:
                s.bind(("", port))
                return port
            except OSError:
                continue
    raise RuntimeError("no free port")


def train_args(corpus, run_dir) -> list[str]:
    return ["--config", "configs/tiny.yaml", "--no-progress", *TINY, f"data.path={corpus}", f"run_dir={run_dir}"]


def losses(run_dir: Path) -> list[float]:
    rows = map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())
    return [r["loss"] for r in rows if "loss" in r]


@pytest.fixture(scope="module")
def one_process(corpus, tmp_path_factory):
    """The losses of the same run in this process, on its 8 devices."""
    from fsdp_jax.app.config import load_config
    from fsdp_jax.app.trainer.loop import train

    run = tmp_path_factory.mktemp("one") / "run"
    args = train_args(corpus, run)
    train(load_config(args[1], args[3:]), progress=False)
    return losses(run)


def start(argv: list[str], envs: list[dict], timeout: int = 400) -> list[subprocess.CompletedProcess]:
    """`argv` once per environment, all at once (the processes of one job); their results."""
    procs = [
        subprocess.Popen(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for env in envs
    ]
    out = []
    try:
        for p in procs:
            stdout, _ = p.communicate(timeout=timeout)
            out.append(subprocess.CompletedProcess(p.args, p.returncode, stdout, ""))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def base_env(**extra) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FSDP_JAX_", "TPU_", "MEGASCALE_"))}
    env.pop("JAX_COORDINATOR_ADDRESS", None)
    env.update(JAX_PLATFORMS="cpu", FSDP_JAX_CPU_DEVICES="4", PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT), **extra)
    cache = ROOT / ".jax_cache"
    env["FSDP_JAX_CACHE_DIR"] = str(cache)
    return env


# ----------------------------------------------------------------------------- SLURM

SRUN = textwrap.dedent("""\
    #!{python}
    # A stand-in for SLURM's srun on one machine: start the job's SLURM_NTASKS tasks of the
    # command with the variables srun gives each task; exit with the first failure's code.
    import os, subprocess, sys
    args = sys.argv[1:]
    while args and args[0].startswith("-"):
        args.pop(0)
    n, per_node = int(os.environ["SLURM_NTASKS"]), int(os.environ["SLURM_NTASKS_PER_NODE"])
    procs = []
    for i in range(n):
        env = dict(os.environ, SLURM_PROCID=str(i), SLURM_LOCALID=str(i % per_node), SLURM_NODEID=str(i // per_node),
                   SLURM_STEP_NODELIST=os.environ["SLURM_JOB_NODELIST"], SLURM_STEP_NUM_NODES=os.environ["SLURM_NNODES"],
                   SLURM_STEP_NUM_TASKS=str(n), SLURM_STEP_ID="0")
        procs.append(subprocess.Popen(args, env=env))
    codes = [p.wait() for p in procs]
    sys.exit(next((c for c in codes if c), 0))
""")


def sbatch(script: Path, nodes: int, per_node: int, args: list[str], tmp: Path) -> subprocess.CompletedProcess:
    """`sbatch --nodes=N --ntasks-per-node=M SCRIPT ARGS` on this machine: the batch script
    once, with the job's variables, its srun the stand-in above. JAX derives the coordinator
    port from the job id (jax._src.clusters.slurm_cluster): the id is chosen so the port is free."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    srun = bin_dir / "srun"
    srun.write_text(SRUN.format(python=sys.executable))
    srun.chmod(srun.stat().st_mode | stat.S_IEXEC)
    port = free_port(65535 - 2**12 + 1, 65535)
    job_id = port - (65535 - 2**12 + 1) + 2**12 * random.randint(1, 100)
    env = base_env(
        PATH=f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        SLURM_JOB_ID=str(job_id),
        SLURM_JOB_NAME="fsdp-jax",
        SLURM_JOB_NODELIST="localhost",  # every node of the job is this machine
        SLURM_NNODES=str(nodes),
        SLURM_NTASKS=str(nodes * per_node),
        SLURM_NTASKS_PER_NODE=str(per_node),
        SLURM_SUBMIT_DIR=str(ROOT),
    )
    return subprocess.run(["bash", str(script), *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)


def sbatch_option(script: Path, name: str) -> str:
    (value,) = re.findall(rf"^#SBATCH --{name}=(\S+)", script.read_text(), re.M)
    return value


@pytest.mark.slow
@pytest.mark.parametrize("recipe, nodes, per_node", [("slurm_per_node.sbatch", 2, 1), ("slurm_per_gpu.sbatch", 1, 2)])
def test_slurm_recipe_trains_like_one_process(recipe, nodes, per_node, corpus, tmp_path, one_process):
    script = RECIPES / recipe
    # the recipe as submitted: its own layout (the test starts fewer tasks, as sbatch options would)
    assert (
        int(sbatch_option(script, "ntasks-per-node")) == {"slurm_per_node.sbatch": 1, "slurm_per_gpu.sbatch": 8}[recipe]
    )
    r = sbatch(script, nodes, per_node, train_args(corpus, tmp_path / "run"), tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    np.testing.assert_allclose(losses(tmp_path / "run"), one_process, rtol=1e-5)


# ----------------------------------------------------------------------------- Kubernetes


def manifest(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((RECIPES / name).read_text()) if d]


def container(pod_spec: dict) -> dict:
    (c,) = pod_spec["containers"]
    return c


@pytest.mark.slow
def test_kubernetes_indexed_job_trains_like_one_process(corpus, tmp_path, one_process):
    service, job = manifest("k8s_indexed_job.yaml")
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    c = container(pod)
    env = {e["name"]: e["value"] for e in c["env"]}
    n = spec["completions"]
    # what makes the pods find each other: one consistent set of names and counts
    assert spec["completionMode"] == "Indexed" and spec["parallelism"] == n == int(env["FSDP_JAX_NUM_PROCESSES"])
    assert service["spec"]["clusterIP"] == "None" and pod["subdomain"] == service["metadata"]["name"]
    host, port = env["FSDP_JAX_COORDINATOR"].rsplit(":", 1)
    assert host == f"{job['metadata']['name']}-0.{service['metadata']['name']}"  # pod 0's name via the Service
    assert int(port) in [p["port"] for p in service["spec"]["ports"]]
    env["FSDP_JAX_COORDINATOR"] = f"127.0.0.1:{free_port()}"  # the Service's name stands for this machine
    argv = [*c["command"], *train_args(corpus, tmp_path / "run")]
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    pods = [base_env(**env, JOB_COMPLETION_INDEX=str(i), HOSTNAME=f"{job['metadata']['name']}-{i}") for i in range(n)]
    results = start(argv, pods)
    # (processes that did not join would each hold the run directory: all but one exit 1)
    assert [r.returncode for r in results] == [0] * n, "\n".join(r.stdout[-2000:] for r in results)
    np.testing.assert_allclose(losses(tmp_path / "run"), one_process, rtol=1e-5)


@pytest.mark.slow
def test_gke_tpu_jobset_trains_like_one_process(corpus, tmp_path, one_process):
    (jobset,) = manifest("gke_tpu_jobset.yaml")
    (rj,) = jobset["spec"]["replicatedJobs"]
    spec, pod = rj["template"]["spec"], rj["template"]["spec"]["template"]["spec"]
    c = container(pod)
    hosts = spec["completions"]
    topology = pod["nodeSelector"]["cloud.google.com/gke-tpu-topology"]
    chips = int(np.prod([int(x) for x in topology.split("x")]))
    assert spec["parallelism"] == hosts == chips // c["resources"]["limits"]["google.com/tpu"] and rj["replicas"] == 1
    assert 8476 in [p["containerPort"] for p in c["ports"]]
    # what GKE gives each pod of the slice (JobSet pod names; here all this machine)
    names = ",".join(["localhost"] * hosts)
    argv = [*c["command"], *train_args(corpus, tmp_path / "run")]
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    port = str(free_port())
    pods = [base_env(TPU_WORKER_HOSTNAMES=names, TPU_WORKER_ID=str(i), JAX_COORDINATOR_PORT=port) for i in range(hosts)]
    results = start(argv, pods)
    assert [r.returncode for r in results] == [0] * hosts, "\n".join(r.stdout[-2000:] for r in results)
    np.testing.assert_allclose(losses(tmp_path / "run"), one_process, rtol=1e-5)


# ----------------------------------------------------------------------------- the settings (fast)


def test_what_the_schedulers_say_becomes_the_settings():
    from fsdp_jax.multihost.clusters import completion_index, gke_tpu_settings

    assert completion_index({"JOB_COMPLETION_INDEX": "3"}) == 3 and completion_index({}) is None
    two = {"TPU_WORKER_HOSTNAMES": "t-0.svc,t-1.svc", "TPU_WORKER_ID": "1"}
    assert gke_tpu_settings(two) == ("t-0.svc:8476", 2, 1)
    multi = {**two, "MEGASCALE_NUM_SLICES": "2", "MEGASCALE_SLICE_ID": "1", "MEGASCALE_COORDINATOR_ADDRESS": "c:9"}
    assert gke_tpu_settings(multi) == ("c:8476", 4, 3)  # as JAX: the megascale host, its own port
    assert gke_tpu_settings({"TPU_WORKER_HOSTNAMES": "only-one", "TPU_WORKER_ID": "0"}) is None
    with pytest.raises(ValueError, match=r"TPU_WORKER_ID='2' is invalid; expected an integer in \[0, 2\)"):
        gke_tpu_settings({**two, "TPU_WORKER_ID": "2"})
    with pytest.raises(ValueError, match="JOB_COMPLETION_INDEX='x' is invalid"):
        completion_index({"JOB_COMPLETION_INDEX": "x"})


def test_an_indexed_job_without_an_index_is_one_line_exit_2(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("FSDP_JAX_COORDINATOR", "fsdp-train-0.fsdp-train:1234")
    monkeypatch.setenv("FSDP_JAX_NUM_PROCESSES", "2")
    monkeypatch.delenv("JOB_COMPLETION_INDEX", raising=False)
    monkeypatch.delenv("FSDP_JAX_PROCESS_ID", raising=False)
    rc, _, err = call("train", "--config", "configs/tiny.yaml", f"run_dir={tmp_path / 'r'}", capsys=capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "set coordinator, num_processes and process_id together" in err and "process_id=None" in err


def test_recipes_name_no_machine_or_registry():
    for f in RECIPES.iterdir():
        text = f.read_text()
        assert not re.search(r"image:\s*\S+/", text), f  # a bare image name (machine paths: test_repo_hygiene)
        if f.suffix == ".sbatch":
            assert shlex.split(re.findall(r"^srun .*$", text, re.M)[0])[-2:] == ["scripts/train.py", "$@"]
