"""Faults in the middle of a run (issue #28): a checkpoint directory that stops being
writable, and a peer process that dies. The contract: one line naming what failed (the
save's step; the dead process), exit code 1, the newest committed checkpoint intact, and
running the same command again resumes exactly. The uninterrupted 2-process run the peer test
ends equal to also serves the check that two processes train like one (was test_multihost's,
with a launch of its own)."""

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax import checkpoint as ck
from helpers import TINY_RUN_OVERRIDES, call, one_line

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = str(ROOT / "configs" / "tiny.yaml")


def _final_params(run_dir: Path, step: int) -> dict:
    c = ck.Checkpointer(run_dir / "checkpoints", read_only=True)
    return {p: c.read_leaf(step, p) for p in c.saved_metadata(step) if p.startswith("params/")}


def _assert_same_params(a: Path, b: Path, step: int) -> None:
    pa, pb = _final_params(a, step), _final_params(b, step)
    assert pa.keys() == pb.keys() and pa
    for k in pa:
        np.testing.assert_array_equal(pa[k], pb[k], err_msg=k)


def _committed(ckpts: Path, step: int) -> bool:
    return (ckpts / str(step) / ck.MANIFEST).is_file()


def _logged_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r["step"] for r in rows if "loss" in r]


def _train_env(**extra) -> dict:
    return dict(os.environ, PYTHONPATH=str(ROOT), JAX_PLATFORMS="cpu", **extra)


# setpriv: the trainer runs as root without the capabilities that ignore file permissions,
# so a directory made read-only refuses it as it would refuse any user
NO_DAC = ["setpriv", "--inh-caps=-dac_override,-dac_read_search", "--bounding-set=-dac_override,-dac_read_search"]


def _can_be_refused() -> bool:
    if not hasattr(os, "geteuid"):
        return False
    return os.geteuid() != 0 or shutil.which("setpriv") is not None


@pytest.mark.slow
@pytest.mark.skipif(not _can_be_refused(), reason="needs a non-root user or setpriv to drop root's override")
def test_checkpoints_made_read_only_mid_run_stop_at_that_save_then_resume_exactly(corpus, tmp_path, capsys):
    """chmod 555 of the checkpoint directory once step 2 is committed: the save of step 4
    fails with EACCES in orbax's threads. One line naming step 4, Permission denied and
    step 2 intact, exit 1, no step past the failed save's next one trained; with the
    permission back, the same command resumes from step 2 and ends bit-identical to a run
    that never failed. The run that fails is a child (its own user rights, its orbax threads, its
    exit); the uninterrupted run and the resume call the same command's main in this process
    (the same 8 CPU devices and XLA flags, so the same compiled programs: one child, not three)."""
    args = [
        "--config",
        TINY_YAML,
        "--no-progress",
        *TINY_RUN_OVERRIDES,
        f"data.path={corpus}",
        "train.steps=6",  # the failed save of step 4 and the resume's save of step 6: 8 steps added nothing
        "train.checkpoint_every=2",
        "train.keep_checkpoints=5",
    ]
    prefix = NO_DAC if os.geteuid() == 0 else []
    train = [*prefix, sys.executable, str(ROOT / "scripts" / "train.py"), *args]
    rc, _, err = call("train", *args, f"run_dir={tmp_path / 'ref'}", capsys=capsys)
    assert rc == 0, err[-3000:]
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    proc = subprocess.Popen(
        train + [f"run_dir={run_dir}"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_train_env(FSDP_JAX_INJECT_DATA_DELAY_S="0.4"),
        cwd=ROOT,
    )
    try:
        deadline = time.monotonic() + 300
        while not _committed(ckpts, 2) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _committed(ckpts, 2), "step 2 was never committed"
        ckpts.chmod(0o555)
        out, err = proc.communicate(timeout=120)  # (it hung for orbax's 300 s timeout before)
    finally:
        proc.kill()
        ckpts.chmod(0o755)
    line = one_line(proc.returncode, err, "writing checkpoint step 4", "Permission denied", "step 2, intact", code=1)
    assert "Traceback" not in out, out[-2000:]
    assert ck.Checkpointer(ckpts, read_only=True).steps() == [2], line
    assert max(_logged_steps(run_dir)) <= 5, _logged_steps(run_dir)  # stopped at the failure, not later
    rc, out, err = call("train", *args, f"run_dir={run_dir}", capsys=capsys)
    assert rc == 0 and "resuming from checkpoint step 2" in out, err[-3000:]
    _assert_same_params(tmp_path / "ref", run_dir, 6)


# -- a peer process that dies ----------------------------------------------------------------------

LAUNCH = [
    sys.executable,
    str(ROOT / "scripts" / "launch.py"),
    "--processes",
    "2",
    "--devices-per-process",
    "4",
    "--grace",
    "5",
    "--",
]


# the job the peer tests run: four kills, each after a newer checkpoint than the kill before's
# (2, 4, 6, 8 when none of them lands after the next checkpoint too), then the end
STEPS = 14


def _two_process_train(corpus, run_dir: Path, steps: int = STEPS) -> list[str]:
    return [*LAUNCH, sys.executable, str(ROOT / "scripts" / "train.py"), *_train_args(corpus, run_dir, steps)]


def _train_args(corpus, run_dir: Path, steps: int) -> list[str]:
    return [
        "--config",
        TINY_YAML,
        "--no-progress",
        *TINY_RUN_OVERRIDES,
        f"data.path={corpus}",
        f"run_dir={run_dir}",
        f"train.steps={steps}",
        "train.checkpoint_every=2",
        "train.keep_checkpoints=10",
    ]


def _child_with(parent: int, process_id: int) -> int | None:
    """The pid of the launcher's child that is `process_id` of the job (from /proc)."""
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            env = (d / "environ").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and f"FSDP_JAX_PROCESS_ID={process_id}".encode() in env:
            return int(d.name)
    return None


@pytest.fixture(scope="module")
def two_process_reference(corpus, tmp_path_factory) -> tuple[Path, str]:
    """(run dir, stdout) of the uninterrupted 2-process run: what each fault test's resumed run
    must end equal to, bit for bit, and what one process must train like (within rounding)."""
    run_dir = tmp_path_factory.mktemp("peer_ref") / "run"
    r = subprocess.run(
        _two_process_train(corpus, run_dir), capture_output=True, text=True, cwd=ROOT, env=_train_env(), timeout=600
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    return run_dir, r.stdout


def _wait_for(ready, proc, deadline: float, poll_s: float = 0.01) -> None:
    while not ready() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(poll_s)


def _kill_under_the_launcher(cmd: list[str], ckpts: Path, when: str, newest: int) -> int:
    """One launch of `cmd`, process 1 killed (-9) `when` ("mid_save": as soon as the checkpoint
    after a newer one than `newest` is being written; "mid_step": in a step once that newer one
    is committed). The launcher's contract, asserted; returns the newest committed step."""
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
        env=_train_env(FSDP_JAX_INJECT_DATA_DELAY_S="0.3"),
    )
    try:
        deadline = time.monotonic() + 400
        target = max(2, newest + 2)  # a checkpoint this launch wrote
        _wait_for(lambda: _committed(ckpts, target), proc, deadline)
        if when == "mid_save":
            _wait_for(lambda: any(ckpts.glob(f"*{ck.TMP_SUFFIX}*")), proc, deadline, 0.002)
        peer = _child_with(proc.pid, 1)
        assert peer is not None and proc.poll() is None, f"the job ended before the kill ({when})"
        os.kill(peer, 9)
        saving = sorted(p.name for p in ckpts.glob(f"*{ck.TMP_SUFFIX}*"))
        assert bool(saving) or when == "mid_step", "no save in flight at the kill"
        killed_at = time.monotonic()
        out, err = proc.communicate(timeout=120)
        stopped_in = time.monotonic() - killed_at
    finally:
        proc.kill()
    line = one_line(proc.returncode, err, "process 1 exited with -9", "SIGKILL", code=1)
    assert stopped_in < 5 + 15, (when, stopped_in, line)  # the grace, plus the launcher's polling
    assert "Traceback" not in out, out[-3000:]
    if newest:
        assert f"[0] resuming from checkpoint step {newest}" in out, out[-3000:]
    committed = ck.Checkpointer(ckpts, read_only=True).steps()
    assert committed and target <= committed[-1] < STEPS, (when, committed)
    return committed[-1]


def _start_without_launcher(cmd: list[str]) -> list[subprocess.Popen]:
    from test_peer_watch import _free_port

    port = _free_port()
    procs = []
    for i in range(2):
        env = _train_env(
            FSDP_JAX_INJECT_DATA_DELAY_S="0.3",
            FSDP_JAX_COORDINATOR=f"127.0.0.1:{port}",
            FSDP_JAX_NUM_PROCESSES="2",
            FSDP_JAX_PROCESS_ID=str(i),
            FSDP_JAX_CPU_DEVICES="4",
        )
        procs.append(
            subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=env)
        )
    return procs


def _kill_without_a_launcher(cmd: list[str], ckpts: Path, victim: int, newest: int) -> int:
    """The two processes of `cmd` started as SLURM or mpirun would (each on its own, nobody
    watching them), `victim` killed (-9) in a step once a newer checkpoint than `newest` is
    committed. The survivor's peer watch contract, asserted; returns the newest committed step."""
    procs = _start_without_launcher(cmd)
    survivor = procs[1 - victim]
    target = max(2, newest + 2)  # a checkpoint this start wrote
    try:
        _wait_for(lambda: _committed(ckpts, target), survivor, time.monotonic() + 400)
        assert procs[0].poll() is None and procs[1].poll() is None, f"the job ended before killing {victim}"
        procs[victim].kill()
        killed_at = time.monotonic()
        out, err = survivor.communicate(timeout=90)
        stopped_in = time.monotonic() - killed_at
    finally:
        for p in procs:
            p.kill()
            p.wait()
    who = "the coordinator, process 0 of 2" if victim == 0 else "process 1 of 2"
    line = one_line(
        survivor.returncode,
        err,
        f"{who} stopped responding",
        f"stopping process {1 - victim}",
        "checkpoint is intact",
        code=1,
    )
    assert stopped_in < 5 + 15, (victim, stopped_in, line)  # the timeout, a few beats, and a loaded machine
    if newest:  # process 0 prints, the survivor or the one killed
        out0 = out if victim == 1 else procs[0].stdout.read()
        assert f"resuming from checkpoint step {newest}" in out0, out0[-3000:]
    committed = ck.Checkpointer(ckpts, read_only=True).steps()
    assert committed and target <= committed[-1] < STEPS, (victim, committed)
    return committed[-1]


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="needs Linux /proc to find the peer process")
def test_a_peer_killed_under_a_launcher_or_without_one_stops_the_job_with_one_line_and_the_run_resumes_exactly(
    corpus, tmp_path, two_process_reference
):
    """One job killed (-9) four times, each start resuming from the newest checkpoint the start
    before it committed. Under the launcher: process 1 as soon as the checkpoint after step 2's
    is being written, then, the same command run again, in a step once a newer checkpoint is
    committed; each time the survivor is blocked in a collective with the dead peer, and the
    launcher says which process died in one line, stops the survivor within its grace and exits
    1. Then the two processes started as SLURM or mpirun would (each on its own, nobody watching
    them): process 1 killed in a step, then, started again that way, process 0 (whose
    coordination service runs in a child of its own, fsdp_jax.multihost.coordination); each time
    the survivor's peer watch (distributed.peer_timeout_s=5) stops it in one line naming the dead
    process and saying the newest checkpoint is intact, exit 1, long before JAX's heartbeat
    abort. After each kill the committed checkpoints restore and a newer one than the kill
    before's is there; the last start, under the launcher, runs to the end, bit-identical to a
    run that never lost a peer (the checkpoint it resumes from was written after three resumes,
    so a wrong resume after any kill shows there). Mutations: distributed.peer_timeout_s=0 (no
    watch) -> SIGABRT after 100 s (exit 134 in a shell) with JAX's multi-line log when process
    1 dies, at once when process 0 dies; the service inside process 0 -> the same at once. Was
    two tests of three starts each (the launcher's kills, the peer watch's), each ending in a
    resume to the end: one start fewer."""
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    launched = _two_process_train(corpus, run_dir)
    newest = 0
    for when in ("mid_save", "mid_step"):
        newest = _kill_under_the_launcher(launched, ckpts, when, newest)
    alone = [sys.executable, str(ROOT / "scripts" / "train.py"), *_train_args(corpus, run_dir, STEPS)]
    for victim in (1, 0):
        newest = _kill_without_a_launcher([*alone, "distributed.peer_timeout_s=5"], ckpts, victim, newest)
    again = subprocess.run(launched, capture_output=True, text=True, cwd=ROOT, env=_train_env(), timeout=600)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    assert f"[0] resuming from checkpoint step {newest}" in again.stdout, again.stdout[-3000:]
    _assert_same_params(two_process_reference[0], run_dir, STEPS)


# -- the same 2-process run against one process ----------------------------------------------------


def _losses(run_dir: Path) -> list[float]:
    rows = [json.loads(l) for l in (run_dir / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow
def test_two_processes_train_like_one_and_checkpoints_move_between_process_counts(
    corpus, tmp_path, capsys, two_process_reference
):
    """The uninterrupted 2-process run (launch; this module's reference) against the same run in
    this one process, its 2-process checkpoint restored on 8 and 4 devices of one process, and
    one process resuming it. (Was in test_multihost.py with a 5-step launch of its own, no
    checkpoint before the last: the fault tests' reference serves both, one launch fewer.)"""
    import jax

    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.models.decoder import Decoder
    from fsdp_jax.app.trainer.optim import build_optimizer
    from fsdp_jax.model.fns import from_nnx
    from fsdp_jax.sharding.mesh import make_mesh
    from fsdp_jax.sharding.strategy import make_plan
    from fsdp_jax.train.state import abstract_state

    two, stdout = two_process_reference
    rc, _, err = call("train", *_train_args(corpus, tmp_path / "one", STEPS), capsys=capsys)
    assert rc == 0, err[-2000:]
    assert "[0] fsdp_jax:" in stdout and "[1] fsdp_jax:" not in stdout  # process 0 prints
    np.testing.assert_allclose(_losses(two), _losses(tmp_path / "one"), rtol=1e-5)
    assert len(_losses(two)) == STEPS

    # the 2-process checkpoint (each process wrote its shards) restores in this single
    # process on 8 devices and on 4 devices, with equal values
    cfg = load_config(two / "config.yaml")
    model = from_nnx(lambda rngs: Decoder(cfg.model, rngs=rngs, remat=cfg.remat))
    opt, _ = build_optimizer(cfg.optimizer, cfg.train.steps)
    restored = []
    for devices in (jax.devices(), jax.devices()[:4]):
        plan = make_plan(model.abstract_params, opt, make_mesh(devices=devices), "full_shard", model.logical_axes)
        state, _ = ck.restore(two / "checkpoints", abstract_state(plan, model.abstract_params, opt))
        restored.append(jax.tree.map(np.asarray, state.params))
    for a, b in zip(jax.tree.leaves(restored[0]), jax.tree.leaves(restored[1])):
        np.testing.assert_array_equal(a, b)
    plan = make_plan(model.abstract_params, opt, make_mesh(), "full_shard", model.logical_axes)
    ref, _ = ck.restore(tmp_path / "one" / "checkpoints", abstract_state(plan, model.abstract_params, opt))
    for a, b in zip(jax.tree.leaves(restored[0]), jax.tree.leaves(ref.params)):
        np.testing.assert_allclose(a, np.asarray(b), atol=1e-5)

    # and one process resumes the 2-process run (a copy: the fault test compares with its last step)
    resumed = tmp_path / "two"
    shutil.copytree(two, resumed)
    rc, _, err = call("train", *_train_args(corpus, resumed, STEPS + 2), capsys=capsys)
    assert rc == 0, err[-2000:]
    assert len(_losses(resumed)) == STEPS + 2
