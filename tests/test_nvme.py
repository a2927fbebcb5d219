"""`offload: optimizer:nvme`: the stacked optimizer state in one file per layer.

Parity runs in a child process with no FMA (`parity_env`: the suite's legacy emitters contract
FMAs by fusion boundary, as tests/test_stream_update.py explains)."""

import concurrent.futures as cf
import errno
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P
from test_offload import ROOT, tiny_llama

import fsdp_jax as fj
from fsdp_jax.checkpoint import direct_io, shard_files
from fsdp_jax.errors import OffloadError, ShardFileError
from fsdp_jax.nvme import LayerFiles, Layout, check_streamable
from fsdp_jax.nvme import layer_files as lf_lib
from fsdp_jax.nvme.checkpoint_stream import StackWriter, rebuild
from fsdp_jax.train.build import build
from helpers import TINY_RUN_OVERRIDES, call, json_child, one_line

# The child: per strategy, 3 steps without offload, and with nvme: 2 steps, the whole state
# gathered out of the files and put into a fresh NvmeStep (as a resume from a checkpoint
# does), a third step; prints losses and the leaves that differ.
_CHILD = r"""
import json, os, sys, tempfile
import jax
jax.config.update("jax_num_cpu_devices", 8)
sys.path.insert(0, "tests")
import numpy as np, optax
from test_offload import ROOT, STRATEGY_MESH, tiny_llama, token_batches
jax.config.update("jax_compilation_cache_dir", str(ROOT / ".jax_cache"))
import fsdp_jax as fj
from fsdp_jax.train.build import build
from fsdp_jax.nvme import NvmeStep

OPT = {"adamw": lambda: optax.adamw(1e-3, weight_decay=0.1), "sgd": lambda: optax.sgd(0.5, momentum=0.9)}
out = {}
for strategy, opt in json.loads(sys.argv[1]):
    m, loss_fn = tiny_llama()
    mesh = fj.make_mesh(**STRATEGY_MESH[strategy])
    b = build(m, OPT[opt](), mesh, strategy, loss_fn=loss_fn)
    state, ref_losses = b.init_state(jax.random.key(0)), []
    batches = token_batches(3, 8)
    for x in batches:
        state, mt = b.train_step(state, x)
        ref_losses.append(float(mt["loss"]))
    with tempfile.TemporaryDirectory() as d1, tempfile.TemporaryDirectory() as d2:
        nv = NvmeStep(b, loss_fn, [d1, d2], owner="t")
        live, losses = nv.put(b.init_state(jax.random.key(0))), []
        for x in batches[:2]:
            live, mt = nv.train_step(live, x)
            losses.append(float(mt["loss"]))
        whole = nv.gather(live)
        nv.close()
        nv = NvmeStep(b, loss_fn, [d1, d2], owner="t")  # the same dirs, claimed by the same run
        live = nv.put(whole)
        live, mt = nv.train_step(live, batches[2])
        losses.append(float(mt["loss"]))
        got = nv.gather(live)
        files = sorted(os.listdir(d1) + os.listdir(d2))
    a = jax.tree_util.tree_flatten_with_path((state.params, state.opt_state))[0]
    bb = jax.tree.leaves((got.params, got.opt_state))
    differ = {
        jax.tree_util.keystr(p): int((np.asarray(x) != np.asarray(y)).sum())
        for (p, x), y in zip(a, bb) if not np.array_equal(np.asarray(x), np.asarray(y))
    }
    out[f"{strategy}/{opt}"] = dict(ref=ref_losses, got=losses, differ=differ, leaves=len(a), files=files,
                                    layer_bytes=nv.layout.nbytes, steps=int(got.step))
print(json.dumps(out))
"""
FAST = [["full_shard", "adamw"]]
STRATEGIES = [[s, "sgd"] for s in ("shard_grad_op", "shard_opt", "no_shard", "hybrid_shard")]


# No FMA: the suite's legacy emitters contract a * b + c into an FMA or not by fusion boundary
# (CI's log: a third loss 1 ulp apart), so per-layer programs and the scanned step could round
# differently. Capped at AVX (no FMA instructions) on x86 they cannot, and the parity children
# keep the suite's fast flags (the default emitters compile 2.8x slower): BENCHMARKS.md "Issue 55
# item 6, nvme and streamed parity on the suite's flags". Elsewhere: the default emitters, as before.
NO_FMA = "--xla_cpu_max_isa=AVX"


def parity_env() -> dict:
    """This environment for a bit-for-bit child: on x86 the suite's flags with no FMA
    (`NO_FMA`), elsewhere XLA:CPU's default emitters (the suite's fusion-emitter flag dropped)."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    if platform.machine().lower() in ("x86_64", "amd64"):
        flags.append(NO_FMA)
    else:
        flags = [f for f in flags if not f.startswith("--xla_cpu_use_fusion_emitters")]
    return dict(os.environ, XLA_FLAGS=" ".join(flags), JAX_PLATFORMS="cpu")


def parity(cases):
    return json_child(_CHILD, json.dumps(cases), env=parity_env())


def assert_exact(r):
    assert r["got"] == r["ref"] and r["ref"][-1] < r["ref"][0]
    assert r["leaves"] > 0 and r["differ"] == {}, r["differ"]
    assert r["steps"] == 3


@pytest.fixture(scope="module")
def parity_runs() -> dict:
    """Both parity tests' cases in one child (one jax start and one cache load, not two)."""
    return parity(FAST + STRATEGIES)


@pytest.mark.slow
def test_nvme_trains_and_resumes_bit_for_bit(parity_runs):
    r = parity_runs["full_shard/adamw"]
    assert_exact(r)
    # the tiny decoder's 2 layers striped over the two dirs, one claim per dir
    assert r["files"] == ["fsdp_jax_nvme.p0.json"] * 2 + ["layer00000.p0.bin", "layer00001.p0.bin"]


@pytest.mark.slow
def test_every_strategy_trains_bit_for_bit(parity_runs):
    for strategy, opt in STRATEGIES:
        assert_exact(parity_runs[f"{strategy}/{opt}"])


# ------------------------------------------------------------------ the files, bad input


def stacked(n_layers=3, mesh=None):
    mesh = mesh or fj.make_mesh(fsdp=8)
    s = NamedSharding(mesh, P(None, "fsdp"))
    return [jax.ShapeDtypeStruct((n_layers, 64, 8), np.float32, sharding=s) for _ in range(2)]


def test_layout_is_aligned_and_shards_once():
    lay = Layout.of(stacked())
    assert len(lay.entries) == 16 and all(e.offset % direct_io.ALIGN == 0 for e in lay.entries)
    assert lay.nbytes == 16 * direct_io.ALIGN  # 8 x 8 x 4 bytes per shard, each padded to a block
    with pytest.raises(OffloadError, match="shards its layer dim"):
        Layout.of([jax.ShapeDtypeStruct((8, 4), np.float32, sharding=NamedSharding(fj.make_mesh(fsdp=8), P("fsdp")))])


def test_write_read_and_a_changed_file(tmp_path):
    files = LayerFiles.open([tmp_path], Layout.of(stacked()), owner="a")
    buf = files.buffer()
    buf[:] = np.arange(buf.size) % 251
    files.write(1, buf)
    back = files.buffer()
    np.testing.assert_array_equal(files.read(1, back), buf)
    with open(files.path(1), "r+b") as f:
        f.seek(100)
        f.write(b"\xff")
    with pytest.raises(OSError, match="changed under the run"):
        files.read(1, back)


def test_a_checkpoint_is_assembled_in_host_memory(tmp_path):
    """`Layout.stacked_on_host` (what `NvmeStep.gather` uses where the backend has host memory):
    each leaf's whole stack from the layer files, sharded as the leaf, in pinned_host."""
    spec = stacked()
    rng = np.random.default_rng(0)
    want = [rng.standard_normal(x.shape).astype(np.float32) for x in spec]
    lay = Layout.of(spec)
    files = LayerFiles.open([tmp_path], lay, owner="a")
    buf = files.buffer()
    for i in range(lay.n_layers):
        layer = [jax.device_put(w[i : i + 1], x.sharding) for w, x in zip(want, spec)]
        lay.from_arrays(layer, buf)
        files.write(i, buf)
    got = lay.stacked_on_host(files, files.buffer(), "pinned_host")
    for g, w, x in zip(got, want, spec):
        assert g.sharding.memory_kind == "pinned_host" and g.sharding.spec == x.sharding.spec
        np.testing.assert_array_equal(np.asarray(g), w)


def _layer_files(d, spec, want, owner="a"):
    lay = Layout.of(spec)
    files = LayerFiles.open([d], lay, owner=owner)
    buf = files.buffer()
    for i in range(lay.n_layers):
        lay.from_arrays([jax.device_put(w[i : i + 1], x.sharding) for w, x in zip(want, spec)], buf)
        files.write(i, buf)
    return files


def test_a_checkpoint_streams_layer_by_layer_and_restores_into_files(tmp_path):
    """The stacked leaves saved out of the layer files (`checkpoint_stream.StackWriter`) are the
    files and index a save of the same arrays from memory writes, byte for byte; `rebuild`
    writes layer files of another mesh's layout from them; a changed file is refused."""
    spec, dirs = stacked(), [tmp_path / n for n in ("nvme", "mem", "streamed", "nvme2")]
    for d in dirs:
        d.mkdir()
    rng = np.random.default_rng(0)
    want = [rng.standard_normal(x.shape).astype(np.float32) for x in spec]
    files = _layer_files(dirs[0], spec, want)
    with cf.ThreadPoolExecutor(1) as ex:
        stacks = StackWriter(files, [files.buffer(), files.buffer()], ex).stacks()
        in_memory = {k: jax.device_put(w, x.sharding) for k, w, x in zip("ab", want, spec)}
        for d, tree in zip(dirs[1:3], [in_memory, dict(zip("ab", stacks))]):
            pieces, meta = shard_files.host_shards(tree)
            shard_files.write_shards(d, shard_files.write_streamed(d, pieces), meta)

    def data(d):  # {file: (start, stop, its data's bytes)} over every leaf
        index = shard_files.read_index(d)
        return {
            f["file"]: (f["start"], f["stop"], (d / f["file"]).read_bytes()[f["offset"] :])
            for m in index.values()
            for f in m["files"]
        }

    assert data(dirs[1]) == data(dirs[2]) and len(data(dirs[2])) == 16
    other = [
        jax.ShapeDtypeStruct(
            x.shape, x.dtype, sharding=NamedSharding(fj.make_mesh(data=2, fsdp=4), P(None, None, "fsdp"))
        )
        for x in spec
    ]
    lay2 = Layout.of(other)
    files2 = LayerFiles.open([dirs[3]], lay2, owner="b")
    rebuild(files2, ["a", "b"], dirs[2], files2.buffer())
    for g, w in zip(lay2.stacked_on_host(files2, files2.buffer(), "pinned_host"), want):
        np.testing.assert_array_equal(np.asarray(g), w)
    got = shard_files.read_tree(dirs[2], {"a": shard_files.Unread((3, 64, 8), np.float32), "b": spec[1]})
    assert isinstance(got["a"], shard_files.Unread)
    np.testing.assert_array_equal(np.asarray(got["b"]), want[1])
    # a save that fails before it writes: the step waiting on it gets the checkpointer's error, not a hang
    with cf.ThreadPoolExecutor(1) as ex:
        pending = StackWriter(files, [files.buffer()] * 2, ex)

        def failed():
            raise OSError("the save failed")

        with pytest.raises(OSError, match="the save failed"):
            pending.wait(failed, poll=0.01)
    victim = sorted(dirs[2].glob("00000.*"))[3]
    raw = bytearray(victim.read_bytes())
    raw[-1] ^= 1
    victim.write_bytes(bytes(raw))
    with pytest.raises(ShardFileError, match=f"{victim.name} has changed since it was saved"):
        rebuild(files2, ["a", "b"], dirs[2], files2.buffer())


def test_a_damaged_streamed_checkpoint_falls_back_to_the_previous_one(tmp_path):
    """Two checkpoints streamed out of the layer files; in the newest a stacked shard file has
    changed: the rebuild (the restore's `then`, as the trainer's resume) refuses it and the
    restore falls back to the older step, whose values the rebuilt layer files then hold."""
    from fsdp_jax.checkpoint import Checkpointer

    spec, rng = stacked(), np.random.default_rng(1)
    (tmp_path / "nvme").mkdir()
    (tmp_path / "nvme2").mkdir()
    wants = [[rng.standard_normal(x.shape).astype(np.float32) for x in spec] for _ in range(2)]
    ckpt = Checkpointer(tmp_path / "ckpt")
    with cf.ThreadPoolExecutor(1) as ex:
        for step, want in enumerate(wants, 1):
            files = _layer_files(tmp_path / "nvme", spec, want)
            stacks = StackWriter(files, [files.buffer(), files.buffer()], ex).stacks()
            ckpt.save(step, {"opt_state": dict(zip("ab", stacks))})
            ckpt.wait()
    victim = next((ckpt.step_dir(2) / "state").glob("00001.*"))
    raw = bytearray(victim.read_bytes())
    raw[0] ^= 1
    victim.write_bytes(bytes(raw))
    files2 = LayerFiles.open([tmp_path / "nvme2"], Layout.of(spec), owner="b")
    target = {"opt_state": {k: shard_files.Unread(x.shape, x.dtype) for k, x in zip("ab", spec)}}
    then = lambda state, d: (rebuild(files2, ["opt_state/a", "opt_state/b"], d, files2.buffer()), state)[1]  # noqa: E731
    got = ckpt.restore(target, then=then)
    ckpt.close()
    assert got.step == 1 and any("step 2" in w and "has changed" in w for w in got.warnings), got.warnings
    for g, w in zip(Layout.of(spec).stacked_on_host(files2, files2.buffer(), "pinned_host"), wants[0]):
        np.testing.assert_array_equal(np.asarray(g), w)


def test_bad_dirs_are_one_line_and_nothing_is_written(tmp_path):
    lay = Layout.of(stacked())
    with pytest.raises(OffloadError, match="does not exist"):
        LayerFiles.open([tmp_path / "nope"], lay, owner="a")
    (tmp_path / "f").write_text("x")
    with pytest.raises(OffloadError, match="not a directory"):
        LayerFiles.open([tmp_path / "f"], lay, owner="a")
    with pytest.raises(OffloadError, match="at least one directory"):
        LayerFiles.open([], lay, owner="a")
    d = tmp_path / "d"
    d.mkdir()
    LayerFiles.open([d], lay, owner="a").write(0, np.zeros(lay.nbytes, np.uint8))
    before = {p.name: p.read_bytes() for p in d.iterdir()}
    with pytest.raises(OffloadError, match="another run"):
        LayerFiles.open([d], lay, owner="b")
    with pytest.raises(OffloadError, match="another state shape"):
        LayerFiles.open([d], Layout.of(stacked(n_layers=5)), owner="a")
    assert {p.name: p.read_bytes() for p in d.iterdir()} == before  # nothing overwritten
    stray = tmp_path / "stray"
    stray.mkdir()
    (stray / "layer00007.p0.bin").write_bytes(b"x")
    with pytest.raises(OffloadError, match="no claim"):
        LayerFiles.open([stray], lay, owner="a")


def test_train_without_dirs_is_one_line_before_anything_runs(tmp_path, capsys):
    """A plan of optimizer:nvme needs no dirs (tests/test_nvme_plan.py); a run does."""
    args = [
        "--config",
        "configs/tiny.yaml",
        *TINY_RUN_OVERRIDES,
        f"run_dir={tmp_path / 'run'}",
        "offload=optimizer:nvme",
    ]
    rc, out, err = call("train", *args, capsys=capsys)
    one_line(rc, err, "offload_dirs")
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_train_with_lora_is_one_line_nothing_written(corpus, tmp_path, capsys):
    """The trainer passes what the nvme step cannot run (frozen params here) to its check."""
    d = tmp_path / "nvme"
    d.mkdir()
    args = [*TINY_RUN_OVERRIDES, f"data.path={corpus}", f"run_dir={tmp_path / 'run'}", f"offload_dirs={d}"]
    rc, out, err = call(
        "train", "--config", "configs/tiny.yaml", *args, "offload=optimizer:nvme", "lora.rank=4", capsys=capsys
    )
    one_line(rc, err, "frozen params")
    assert list(d.iterdir()) == []


def test_too_little_space_names_the_bytes(tmp_path, monkeypatch):
    lay = Layout.of(stacked())

    class Tiny:
        f_bavail, f_frsize = 2, 4096

    monkeypatch.setattr(lf_lib.os, "statvfs", lambda _: Tiny)
    with pytest.raises(OffloadError, match=f"needs {3 * lay.nbytes} bytes"):
        LayerFiles.open([tmp_path], lay, owner="a")
    assert list(tmp_path.iterdir()) == []


def test_disk_full_on_write_is_one_line(tmp_path, monkeypatch):
    files = LayerFiles.open([tmp_path], Layout.of(stacked()), owner="a")

    def full(path, a):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(direct_io, "write_file", full)
    with pytest.raises(OSError, match="the disk is full"):
        files.write(0, files.buffer())


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_a_dir_on_tmpfs_warns():
    with tempfile.TemporaryDirectory(dir="/dev/shm") as d:
        if lf_lib.fs_type(Path(d)) != "tmpfs":
            pytest.skip("/dev/shm is not tmpfs here")
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            LayerFiles.open([d], Layout.of(stacked()), owner="a")
        assert any("memory, not a disk" in str(x.message) for x in w)


def test_an_optimizer_it_cannot_stream_is_refused():
    m, loss_fn = tiny_llama()
    b = build(m, optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3)), fj.make_mesh(fsdp=8), "full_shard")
    with pytest.raises(OffloadError, match="updates one layer at a time from disk, but the optimizer update uses"):
        check_streamable(b, {})
    with pytest.raises(OffloadError, match="random numbers"):
        check_streamable(build(m, optax.adam(1e-3), fj.make_mesh(fsdp=8), "full_shard"), {"rng": 0})


# ------------------------------------------------------------------ the trainer, kill -9

# The trainer's command in a child whose `n`-th layer-file write kills the process (SIGKILL),
# mid-step (the files then hold layers of two different steps), once the checkpoint dir
# `argv[2]` is committed (the save is asynchronous).
_KILL_CHILD = r"""
import os, runpy, signal, sys, time
from fsdp_jax.nvme import layer_files
n, ckpt, write, count = int(sys.argv[1]), sys.argv[2], layer_files.LayerFiles.write, [0]
def killing_write(self, i, buf):
    count[0] += 1
    if count[0] == n:
        for _ in range(600):
            if os.path.isdir(ckpt):
                break
            time.sleep(0.1)
        os.kill(os.getpid(), signal.SIGKILL)
    return write(self, i, buf)
layer_files.LayerFiles.write = killing_write
sys.argv = ["train", *sys.argv[3:]]
runpy.run_path("scripts/train.py", run_name="__main__")
"""


def _losses(run_dir):
    rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


# per nvme offload: the layer-file write that kills the run, in step 4 with 2 layers. optimizer:nvme
# writes a layer's state file at start and once a step (the 10th: layer 1 of step 4, layer 0
# written); optimizer+params:nvme writes params and state per layer at start (4), then per step
# grads (2, backward) and params + state per layer (4, update): the 27th is layer 1's params of
# step 4, after layer 0's params and state
KILL_AT = {"optimizer:nvme": 10, "optimizer+params:nvme": 27}


def _kill_run_args(corpus, tmp_path: Path, name: str, offload: str) -> list[str]:
    d = tmp_path / f"{name}_nvme"
    d.mkdir(exist_ok=True)
    over = TINY_RUN_OVERRIDES + [f"data.path={corpus}", f"run_dir={tmp_path / name}", f"offload={offload}"]
    return ["--config", "configs/tiny.yaml", *over, f"offload_dirs={d}", "train.steps=4", "train.checkpoint_every=2"]


def _train_child(code_args: list[str]) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    return subprocess.run([sys.executable, *code_args], cwd=ROOT, env=env, capture_output=True, text=True)


@pytest.fixture(scope="module")
def plain_losses(corpus, tmp_path_factory) -> dict:
    """The kill tests' run without offload (the same for both nvme offloads: one run, in this
    process: only the killed run needs a process of its own)."""
    from helpers import script

    tmp = tmp_path_factory.mktemp("nvme_plain")
    assert script("train").main(_kill_run_args(corpus, tmp, "plain", "none")) == 0
    return _losses(tmp / "plain")


@pytest.mark.slow
@pytest.mark.parametrize("nvme", list(KILL_AT))
def test_kill_9_mid_step_then_the_same_command_resumes_exactly(corpus, tmp_path, nvme, plain_losses, capsys):
    """The run with `nvme` killed (-9) mid-step after the step-2 checkpoint, then the same
    command: it resumes from step 2 and logs the uninterrupted run's losses bit for bit
    (within 1e-6 of the run without offload); another run's command on the same dir is refused
    in one line. Only the killed run is a child: the uninterrupted run, the resume and the
    refusal run in process (`call`, the child's XLA flags: the same programs)."""

    def args(name):
        return _kill_run_args(corpus, tmp_path, name, nvme)

    rc, _, err = call("train", *args("straight"), capsys=capsys)
    assert rc == 0, err[-2000:]
    killed = _train_child(
        ["-c", _KILL_CHILD, str(KILL_AT[nvme]), str(tmp_path / "kill" / "checkpoints" / "2"), *args("kill")]
    )
    assert killed.returncode == -signal.SIGKILL
    assert sorted(p.name for p in (tmp_path / "kill" / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    rc, out, err = call("train", *args("kill"), capsys=capsys)
    assert rc == 0, err[-2000:]
    assert "resuming from checkpoint step 2" in out
    want = _losses(tmp_path / "straight")
    assert sorted(want) == [1, 2, 3, 4] and _losses(tmp_path / "kill") == want
    np.testing.assert_allclose([want[k] for k in range(1, 5)], [plain_losses[k] for k in range(1, 5)], rtol=1e-6)
    # another run's command on the same dir: one line, exit 2, the files untouched
    before = {p.name: p.stat().st_mtime_ns for p in (tmp_path / "kill_nvme").iterdir()}
    rc, _, err = call(
        "train", *args("other")[:-2], f"offload_dirs={tmp_path / 'kill_nvme'}", "train.steps=4", capsys=capsys
    )
    one_line(rc, err, "another run")
    assert {p.name: p.stat().st_mtime_ns for p in (tmp_path / "kill_nvme").iterdir()} == before


@pytest.mark.slow
def test_two_processes_each_stream_their_own_files_and_resume_exactly(corpus, tmp_path):
    """2 processes x 4 devices over gloo, on XLA:CPU's default emitters (as `parity`): the same
    run without offload, then with nvme killed (-9, both processes) in step 3 after the step-2
    checkpoint, then the same command, which resumes through the streamed restore (each process
    rebuilds its own layer files from the checkpoint's shard files). Each process wrote only its
    own shards' files (`.p0` / `.p1`, its own claim), and the killed-and-resumed nvme run logs
    the run without offload's losses and ends with its params and optimizer state, bit for bit.
    Three launches (was four: an uninterrupted nvme run compared within 1e-6, 444 s loaded)."""
    from test_multihost import ROOT as MROOT
    from test_multihost import launch, train_args

    from fsdp_jax import checkpoint as ck
    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.models.decoder import Decoder
    from fsdp_jax.app.trainer.optim import build_optimizer
    from fsdp_jax.model.fns import from_nnx
    from fsdp_jax.sharding.mesh import make_mesh
    from fsdp_jax.sharding.strategy import make_plan
    from fsdp_jax.train.state import abstract_state

    def two(run_dir, disk, *code):
        # 3 steps of 8 rows of 16 tokens (one row a device): a checkpoint at 2, a kill in 3
        extra = ["train.steps=3", "train.checkpoint_every=2", "train.global_batch=8", "data.seq_len=16"]
        if disk is not None:
            disk.mkdir(exist_ok=True)
            extra += ["offload=optimizer:nvme", f"offload_dirs={disk}"]
        return launch(
            "--processes", "2", "--devices-per-process", "4", "--grace", "5", "--", sys.executable,
            *(code or [str(MROOT / "scripts" / "train.py")]), *train_args(corpus, run_dir, *extra), timeout=600,
            env={"XLA_FLAGS": parity_env()["XLA_FLAGS"]},
        )  # fmt: skip

    r = two(tmp_path / "none", None)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    want = _losses(tmp_path / "none")
    assert sorted(want) == [1, 2, 3]
    # kill -9 both processes in step 3 (their 8th layer write: 2 at start, 2 a step) once the
    # step-2 checkpoint is committed, then the same command
    kill, d = tmp_path / "kill", tmp_path / "disk"
    r = two(kill, d, "-c", _KILL_CHILD, "8", str(kill / "checkpoints" / "2"))
    assert r.returncode != 0 and "exited with -9" in r.stderr, r.stderr[-2000:]
    assert sorted(p.name for p in (kill / "checkpoints").iterdir() if p.name.isdigit()) == ["2"]
    names = sorted(p.name for p in d.iterdir())
    assert names == [
        "fsdp_jax_nvme.p0.json", "fsdp_jax_nvme.p1.json",
        "layer00000.p0.bin", "layer00000.p1.bin", "layer00001.p0.bin", "layer00001.p1.bin",
    ]  # fmt: skip
    claims = [json.loads((d / f"fsdp_jax_nvme.p{i}.json").read_text()) for i in (0, 1)]
    assert claims[0]["owner"] == claims[1]["owner"] == str(kill.resolve())
    r = two(kill, d)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "resuming from checkpoint step 2" in r.stdout
    assert _losses(kill) == want
    cfg = load_config(tmp_path / "none" / "config.yaml")
    model = from_nnx(lambda rngs: Decoder(cfg.model, rngs=rngs, remat=cfg.remat))
    opt, _ = build_optimizer(cfg.optimizer, cfg.train.steps)
    plan = make_plan(model.abstract_params, opt, make_mesh(), "full_shard", model.logical_axes)
    target = abstract_state(plan, model.abstract_params, opt)
    got = [ck.restore(p / "checkpoints", target)[0] for p in (kill, tmp_path / "none")]
    assert int(got[0].step) == int(got[1].step) == 3
    for a, b in zip(
        jax.tree.leaves((got[0].params, got[0].opt_state)), jax.tree.leaves((got[1].params, got[1].opt_state))
    ):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_save_that_raises_is_dropped_so_the_step_does_not_wait_for_it():
    """The trainer's checkpoint hook hands `nvme_run.saved`'s state to the checkpointer inside
    the context; a save that raises there is forgotten (`NvmeStep.drop_save`), since no
    commit will ever stream it and the next step would wait for it forever."""
    from types import SimpleNamespace

    from fsdp_jax.app.trainer import nvme_run

    calls = []
    nv = SimpleNamespace(to_save=lambda s, check: calls.append(("to_save", check)) or ("streamed", s))
    nv.drop_save = lambda: calls.append(("drop",))
    run = SimpleNamespace(nvme=nv, checkpointer=SimpleNamespace(check="ckpt.check"))
    with nvme_run.saved(run, "live") as state:
        assert state == ("streamed", "live")
    assert calls == [("to_save", "ckpt.check")]
    with pytest.raises(OSError, match="no space"):
        with nvme_run.saved(run, "live"):
            raise OSError("no space")
    assert calls[-1] == ("drop",)
    with nvme_run.saved(SimpleNamespace(nvme=None), "live") as state:
        assert state == "live"


@pytest.mark.slow  # 17 s on the loaded 2-core machine: five compiles
def test_layer_programs_equal_the_scanned_model_bit_for_bit():
    """The measurement behind `optimizer+params:nvme`'s planned driver (docs/offload.md "Params
    on disk"): the embedding, each layer (forward, then its vjp in reverse from the kept input)
    and the head as their own jitted programs give the scanned model's loss and grads bit for bit
    (one device, float32, no remat; benchmarks/nvme_layerwise_parity.py)."""
    from flax import nnx

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from nvme_layerwise_parity import compare

    with nnx.use_eager_sharding(False):
        r = compare(layers=2, batch=2, seq=16, seed=1)
    assert r["loss_equal"] and r["grads"] == 12 and r["grads_equal"] == r["grads"], r["per_leaf"]
