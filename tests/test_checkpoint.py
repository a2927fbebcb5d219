"""Checkpoints and fault tolerance: exact resume, restore onto other meshes and
strategies, preemption, kill -9, damaged checkpoints, shape mismatches, the
non-finite guard, safetensors export and init_from.

One straight 20-step run (module fixture) is the reference: every interrupted and
resumed run must end with bit-identical params and identical per-step losses.
"""

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import pytest

from fsdp_jax import checkpoint as ck
from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.exits import BAD_INPUT
from fsdp_jax.app.models import Decoder
from fsdp_jax.app.trainer.loop import train
from fsdp_jax.app.trainer.optim import build_optimizer
from fsdp_jax.app.trainer.setup import setup
from fsdp_jax.errors import TrainingDiverged
from fsdp_jax.model.fns import from_nnx
from fsdp_jax.sharding.mesh import make_mesh
from fsdp_jax.sharding.strategy import make_plan
from fsdp_jax.train.state import abstract_state
from helpers import TINY_RUN_OVERRIDES, call, script

# end-to-end training runs and subprocesses: the whole file is outside the fast subset
pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
STEPS = 20
TINY = TINY_RUN_OVERRIDES + [f"train.steps={STEPS}"]


def overrides(corpus, run_dir, *extra):
    return TINY + [f"data.path={corpus}", f"run_dir={run_dir}", *extra]


def config(corpus, run_dir, *extra):
    return load_config(ROOT / "configs" / "tiny.yaml", overrides(corpus, run_dir, *extra))


def records(run_dir: Path) -> dict[int, dict]:
    """Per-step loss / lr / grad_norm from metrics.jsonl (timings differ between runs)."""
    out = {}
    for line in (Path(run_dir) / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if "loss" in r:
            out[r["step"]] = (r["loss"], r["lr"], r["grad_norm"])
    return out


def host(tree):
    return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(tree))]


def assert_same(a, b):
    la, lb = host(a), host(b)
    assert len(la) == len(lb)
    for x, y in zip(la, lb):
        np.testing.assert_array_equal(x, y)


def target_for(cfg, mesh, strategy):
    """The abstract TrainState of the run's model/optimizer on `mesh` with `strategy`."""
    model = from_nnx(lambda rngs: Decoder(cfg.model, rngs=rngs, remat=cfg.remat))
    opt, _ = build_optimizer(cfg.optimizer, cfg.train.steps)
    abstract = jax.eval_shape(model.init, jax.random.key(0))
    plan = make_plan(abstract, opt, mesh, strategy, model.logical_axes)
    return abstract_state(plan, abstract, opt), plan, model, opt


def final_state(run_dir: Path, cfg):
    target, *_ = target_for(cfg, make_mesh(), "full_shard")
    return ck.restore(Path(run_dir) / "checkpoints", target, step=STEPS)[0]


def biggest_file(step_dir: Path) -> Path:
    return max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


@pytest.fixture(scope="module")
def straight(corpus, tmp_path_factory):
    """20 steps without interruption; checkpoints at 10, 15, 20 kept (every 5, keep 3)."""
    run_dir = tmp_path_factory.mktemp("straight") / "run"
    cfg = config(corpus, run_dir, "train.checkpoint_every=5")
    summary = train(cfg, progress=False)
    return {"dir": run_dir, "cfg": cfg, "state": jax.device_get(summary["run"].state), "records": records(run_dir)}


def copy_run(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


# -- in process -------------------------------------------------------------------------------


def test_checkpoint_contents(straight):
    d = straight["dir"] / "checkpoints"
    assert ck.latest_step(d) == STEPS and ck.Checkpointer(d, read_only=True).steps() == [10, 15, 20]
    state, extras = ck.restore(d, target_for(straight["cfg"], make_mesh(), "full_shard")[0])
    assert extras["step"] == STEPS and extras["data"] == {"step": STEPS}
    assert extras["rng"] == {"impl": "threefry2x32", "data": [0, 0]}
    assert extras["config"]["model"]["d_model"] == 64 and extras["config"]["train"]["steps"] == STEPS
    assert (d / str(STEPS) / ck.MANIFEST).is_file()
    assert_same(state, straight["state"])


def test_exact_resume_in_process(corpus, straight, tmp_path):
    cfg = config(corpus, tmp_path / "run", "train.checkpoint_every=5")
    first = train(cfg, progress=False, stop_after=10)
    assert first["preempted"] == "stop_after=10"
    assert ck.latest_step(tmp_path / "run" / "checkpoints") == 10
    second = train(cfg, progress=False)
    assert second["run"].start_step == 10 and "preempted" not in second
    assert_same(second["run"].state, straight["state"])  # bit-identical
    assert records(tmp_path / "run") == straight["records"]  # losses, lr, grad norms, data order


@pytest.mark.parametrize(
    "n_devices, data, strategy",
    [(4, 1, "full_shard"), (8, 2, "hybrid_shard"), (1, 1, "full_shard"), (8, 1, "no_shard")],
)
def test_restore_onto_other_meshes_and_continue(straight, n_devices, data, strategy):
    mesh = make_mesh(data=data, fsdp=-1, devices=jax.devices()[:n_devices])
    cfg = straight["cfg"]
    target, plan, model, opt = target_for(cfg, mesh, strategy)
    state, _ = ck.restore(straight["dir"] / "checkpoints", target)
    assert_same(state, straight["state"])
    for leaf, sds in zip(jax.tree.leaves(state), jax.tree.leaves(target)):
        assert leaf.sharding == sds.sharding
    from fsdp_jax.app.trainer.build import make_loss_fn
    from fsdp_jax.train.step import make_train_step

    step = make_train_step(make_loss_fn(model), opt, plan)
    batch = jax.device_put(np.full((16, 33), 7, np.int32), plan.batch)
    state, metrics = step(state, batch)
    assert int(state.step) == STEPS + 1 and np.isfinite(float(metrics["loss"]))


def test_damaged_newest_falls_back_and_resume_is_exact(corpus, straight, tmp_path, capsys):
    run_dir = copy_run(straight["dir"], tmp_path / "run")
    d = run_dir / "checkpoints"
    big = biggest_file(d / "20")
    os.truncate(big, big.stat().st_size // 2)
    # Resuming restores step 15 (warning names step 20), redoes 16..20, and matches.
    summary = train(config(corpus, run_dir, "train.checkpoint_every=5"), progress=False)
    out = capsys.readouterr().out
    assert "checkpoint step 20" in out and "damaged" in out and "resuming from checkpoint step 15" in out
    assert (run_dir / "checkpoints.damaged" / "20").is_dir()
    assert_same(summary["run"].state, straight["state"])
    assert records(run_dir) == straight["records"]


# Orbax reads every shard concurrently; when one read fails, the reads still pending are
# dropped unawaited and complain when garbage-collected ("Exception ignored in: <coroutine
# _read_array_index_and_device_put>"), in whichever later test that happens. Collected here.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_deleted_files_fall_back_and_nothing_restorable_is_an_error(straight, tmp_path):
    d = copy_run(straight["dir"] / "checkpoints", tmp_path / "ckpts")
    target = target_for(straight["cfg"], make_mesh(), "full_shard")[0]
    biggest_file(d / "20").unlink()
    (d / "15" / "state" / "shards.0.json").unlink()  # the shard index
    r = ck.Checkpointer(d, read_only=True).restore(target)
    assert r.step == 10 and len(r.warnings) == 2
    assert "step 20" in r.warnings[0] and "missing" in r.warnings[0] and "step 15" in r.warnings[1]
    (d / "10" / ck.MANIFEST).unlink()  # e.g. written by plain orbax: restored, unverified
    r = ck.Checkpointer(d, read_only=True).restore(target, step=10)
    assert r.step == 10 and "unverified" in r.warnings[0]
    assert_same(r.state.step, 10)
    os.truncate(biggest_file(d / "10"), 3)  # the reader's own error is the fallback's third line
    with pytest.raises(ck.CheckpointError, match="no checkpoint restores.*step 20.*step 15.*step 10"):
        ck.Checkpointer(d, read_only=True).restore(target)
    assert ck.CheckpointError in BAD_INPUT  # -> exit 2, one line
    gc.collect()  # orbax's abandoned shard reads (see above)


def test_nonfinite_steps_are_skipped_then_the_run_stops(corpus, tmp_path, capsys):
    from fsdp_jax.app.trainer.faults import Faults

    cfg = config(corpus, tmp_path / "run", "train.checkpoint_every=2", "train.max_nonfinite_steps=3")
    with pytest.raises(TrainingDiverged, match=r"3 non-finite steps in a row \(steps 6-8.*step 4"):
        train(cfg, progress=False, faults=Faults(nan_steps=frozenset({3, 6, 7, 8})))
    out = capsys.readouterr().out
    for s in (3, 6, 7, 8):
        assert f"warning: step {s}: non-finite" in out
    d = tmp_path / "run" / "checkpoints"
    # 2 and 4 saved; none during the skip run (6) nor at the stop (8): the last good update.
    assert ck.Checkpointer(d, read_only=True).steps() == [2, 4]
    state, extras = ck.restore(d, target_for(cfg, make_mesh(), "full_shard")[0])
    assert extras["step"] == 4 and int(state.step) == 3  # step 3 was skipped
    assert all(np.isfinite(x).all() for x in host(state.params))


def run_script(name, *args):
    return script(name).main([str(a) for a in args])


def test_export_round_trip_and_init_from(corpus, straight, tmp_path, capsys):
    from safetensors.numpy import load_file

    params = ck.tree_paths(straight["state"].params)
    out = tmp_path / "model.safetensors"
    assert run_script("export", straight["dir"], "--out", out) == 0
    loaded = load_file(out)  # the reference reader agrees with our writer
    assert loaded.keys() == params.keys() and "blocks/attn/wq" in loaded
    for k, v in params.items():
        np.testing.assert_array_equal(loaded[k], v)
    assert (
        run_script(
            "export", straight["dir"], "--out", tmp_path / "bf16.safetensors", "--dtype", "bfloat16", "--step", 15
        )
        == 0
    )
    assert str(ck.open_safetensors(tmp_path / "bf16.safetensors").dtype("embed")) == "bfloat16"
    # init_from: the file's values, placed sharded, fresh optimizer state, step 0.
    run = setup(config(corpus, tmp_path / "ft", f"init_from={out}"))
    assert run.start_step == 0 and int(run.state.step) == 0
    for k, v in ck.tree_paths(run.state.params).items():
        np.testing.assert_array_equal(np.asarray(v), params[k])
    assert run.state.params["embed"].sharding == run.plan.params["embed"]
    assert int(jax.tree.leaves(run.state.opt_state)[0]) == 0
    # init_from a run directory reads only its params.
    run = setup(config(corpus, tmp_path / "ft2", f"init_from={straight['dir']}"))
    assert_same(run.state.params, straight["state"].params)
    with pytest.raises(
        ck.CheckpointError,
        match=r"init_from: .*blocks/attn/wq: checkpoint \(2, 64, 4, 16\) "
        r"vs model \(2, 32, 4, 8\)",
    ):
        setup(config(corpus, tmp_path / "ft3", f"init_from={out}", "model.d_model=32"))
    capsys.readouterr()
    assert run_script("export", tmp_path / "nope", "--out", tmp_path / "x.safetensors") == 2
    assert "error: " in capsys.readouterr().err


# -- signals and kill -9 need a trainer process; the resumes and exit codes run in process -------


def here(corpus, run_dir, *extra, capsys, env=None):
    """(exit code, stdout, stderr) of scripts/train.py's main() in this process."""
    return call(
        "train",
        "--config",
        "configs/tiny.yaml",
        "--no-progress",
        *overrides(corpus, run_dir, *extra),
        capsys=capsys,
        env=env,
    )


def start(corpus, run_dir, *extra):
    """`python scripts/train.py ...` started in a child process (to signal or kill)."""
    cmd = [
        sys.executable,
        str(ROOT / "scripts" / "train.py"),
        "--config",
        "configs/tiny.yaml",
        "--no-progress",
        *overrides(corpus, run_dir, *extra),
    ]
    env = dict(os.environ, FSDP_JAX_CPU_DEVICES="8", FSDP_JAX_CACHE_DIR=str(ROOT / ".jax_cache"))
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def wait_for(predicate, timeout=90.0, poll=0.005):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(poll)
    return False


def logged_steps(run_dir: Path) -> int:
    p = run_dir / "metrics.jsonl"
    return len(p.read_text().splitlines()) if p.exists() else 0


def test_sigterm_finishes_the_step_checkpoints_exits_0_and_resumes_exactly(corpus, straight, tmp_path, capsys):
    run_dir = tmp_path / "run"
    proc = start(corpus, run_dir, "train.checkpoint_every=0")
    try:
        assert wait_for(lambda: logged_steps(run_dir) >= 1 or proc.poll() is not None)
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=90)
    finally:
        proc.kill()
    assert proc.returncode == 0, err
    assert "stopped (SIGTERM)" in out
    stopped = ck.latest_step(run_dir / "checkpoints")
    assert 1 <= stopped < STEPS, out
    rc, out, err = here(corpus, run_dir, "train.checkpoint_every=0", capsys=capsys)
    assert rc == 0, err
    assert f"resuming from checkpoint step {stopped}" in out
    assert_same(final_state(run_dir, straight["cfg"]), straight["state"])
    assert records(run_dir) == straight["records"]


def test_kill_9_mid_save_then_resume(corpus, straight, tmp_path, capsys):
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    proc = start(corpus, run_dir, "train.checkpoint_every=1", "train.keep_checkpoints=2")
    try:
        # Once a few checkpoints exist, kill while the next one is being written.
        caught = wait_for(
            lambda: (logged_steps(run_dir) >= 3 and any(ckpts.glob(f"*{ck.TMP_SUFFIX}*"))) or proc.poll() is not None
        )
        proc.kill()  # SIGKILL
        proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert caught and proc.returncode == -signal.SIGKILL
    partial = sorted(ckpts.glob(f"*{ck.TMP_SUFFIX}*"))
    if not partial:  # the save committed between the poll and the kill: make the partial by hand
        newest = ck.latest_step(ckpts)
        fake = ckpts / f"{newest + 1}{ck.TMP_SUFFIX}"
        shutil.copytree(ckpts / str(newest), fake)
        biggest_file(fake).unlink()
        partial = [fake]
    # the resume saves at its end only: what follows reads the final checkpoint and the metrics, not the
    # 17 saves between (each an Orbax write of the whole state)
    rc, out, err = here(corpus, run_dir, "train.checkpoint_every=0", "train.keep_checkpoints=2", capsys=capsys)
    assert rc == 0, err
    assert f"ignoring partial checkpoint {partial[0]}" in out
    assert not any(ckpts.glob(f"*{ck.TMP_SUFFIX}*"))
    assert_same(final_state(run_dir, straight["cfg"]), straight["state"])
    assert records(run_dir) == straight["records"]


def test_shape_mismatch_exits_2_naming_paths_and_shapes(corpus, straight, tmp_path, capsys):
    run_dir = copy_run(straight["dir"], tmp_path / "run")
    rc, _, err = here(corpus, run_dir, "model.d_model=32", capsys=capsys)
    assert rc == 2, err
    lines = [l for l in err.splitlines() if l.strip() and "warn" not in l.lower()]
    assert len(lines) == 1 and lines[0].startswith("error: checkpoint "), err
    assert "does not fit the model" in lines[0] and "Traceback" not in err
    assert "params/embed: checkpoint (256, 64) vs model (256, 32)" in lines[0]
    assert ck.Checkpointer(run_dir / "checkpoints", read_only=True).steps() == [10, 15, 20]


def test_nonfinite_stop_exits_1(corpus, tmp_path, capsys):
    rc, out, err = here(
        corpus, tmp_path / "run", "train.checkpoint_every=2", env={"FSDP_JAX_INJECT_NAN_STEPS": "5,6,7"}, capsys=capsys
    )
    assert rc == 1, err
    assert "error: 3 non-finite steps in a row (steps 5-7" in err and "step 4 in" in err
    assert "warning: step 5: non-finite" in out
