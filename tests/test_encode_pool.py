"""The worker pool of prepare --workers without pickle: nothing is pickled in the main
process or in a worker, a worker killed mid-run is one line and exit 1 with nothing left
in --out, and the workers are reaped when the run ends early and end when their parent
dies. (Byte-for-byte parity with one worker: tests/test_prepare_scaling.py.)"""

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from test_prepare_scaling import LLAMA2, corpus_files, mixed

from fsdp_jax.app.data import encode_pool, encode_worker
from fsdp_jax.app.data import sft as sft_data
from fsdp_jax.app.data.encode_pool import encode_batches
from fsdp_jax.app.data.encode_worker import EncoderSpec
from fsdp_jax.app.data.sft import prepare_examples

# A worker bootstrap that runs `prelude` first, then the real worker.
PKG = str(Path(encode_pool.__file__).resolve().parents[2])  # the fsdp_jax package directory


def worker_argv(prelude: str) -> list[str]:
    return [sys.executable, "-c", textwrap.dedent(prelude) + "\n" + encode_worker.BOOT, PKG]


# jinja2 pickles a version tuple when it is imported (its bytecode cache's magic): imported
# first, like the tokenizers; from then on nothing may pickle.
NO_PICKLE = """
    import sys
    import jinja2, tokenizers
    def _no(*a, **k):
        raise AssertionError("pickle used")
    import pickle, copyreg
    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        setattr(pickle, name, _no)
    for name in ("multiprocessing", "concurrent.futures", "_pickle"):
        sys.modules[name] = None  # importing any of them fails
"""


@pytest.mark.slow
def test_no_pickle_in_the_main_process_or_the_workers(tmp_path, monkeypatch):
    import pickle  # noqa: TID251 (poisoned, not used)
    from multiprocessing import reduction

    import jinja2  # noqa: F401 (pickles a version tuple when imported: see NO_PICKLE)

    def no(*a, **k):
        raise AssertionError("pickle used")

    for name in ("dumps", "loads", "dump", "load", "Pickler", "Unpickler"):
        monkeypatch.setattr(pickle, name, no)
    monkeypatch.setattr(reduction.ForkingPickler, "dumps", no)  # what multiprocessing pickles with
    monkeypatch.setattr(reduction.ForkingPickler, "loads", no)
    monkeypatch.setattr(encode_pool, "WORKER_ARGV", worker_argv(NO_PICKLE))
    monkeypatch.setattr(sft_data, "BATCH_BYTES", 2000)  # many batches
    src = mixed(tmp_path / "a.jsonl", 200)
    kw = dict(row_len=128, tokenizer=LLAMA2, val_fraction=0.1, overflow="split")
    two = prepare_examples([src], tmp_path / "w2", workers=2, **kw)
    monkeypatch.undo()
    one = prepare_examples([src], tmp_path / "w1", **kw)
    assert one == two and corpus_files(tmp_path / "w1") == corpus_files(tmp_path / "w2")


KILL_ON_THIRD_BATCH = """
    import os, signal
    from fsdp_jax.app.data import encode_worker as w
    _reply, _n = w.encode_reply, [0]
    def encode_reply(examples):
        _n[0] += 1
        if _n[0] == 3:
            os.kill(os.getpid(), signal.SIGKILL)
        return _reply(examples)
    w.encode_reply = encode_reply
"""


def spy_on_workers(monkeypatch) -> list:
    """The worker processes the pool starts, kept to check they were reaped."""
    procs, popen = [], subprocess.Popen

    def spy(*a, **k):
        procs.append(popen(*a, **k))
        return procs[-1]

    monkeypatch.setattr(encode_pool.subprocess, "Popen", spy)
    return procs


@pytest.mark.slow
def test_a_killed_worker_is_one_line_exit_1_and_nothing_in_out(tmp_path, monkeypatch, capsys):
    from test_packing import prep_script

    monkeypatch.setattr(encode_pool, "WORKER_ARGV", worker_argv(KILL_ON_THIRD_BATCH))
    monkeypatch.setattr(sft_data, "BATCH_BYTES", 2000)
    procs = spy_on_workers(monkeypatch)
    src = mixed(tmp_path / "a.jsonl", 300)
    for out in (tmp_path / "new", tmp_path / "existing"):  # made by the run / there before it
        if out.name == "existing":
            out.mkdir()
        code = prep_script().main(
            ["--out", str(out), str(src), "--pack", "128", "--tokenizer", LLAMA2, "--workers", "2", "--no-progress"]
        )
        err = capsys.readouterr().err
        assert code == 1 and err.startswith("error: encoding worker ") and err.count("\n") == 1, err
        assert "was killed by SIGKILL" in err, err
        assert not out.exists() if out.name == "new" else list(out.iterdir()) == []
    assert len(procs) == 4 and all(p.returncode is not None for p in procs)  # reaped: no zombie


@pytest.mark.slow
def test_workers_are_reaped_when_the_run_stops_early(tmp_path, monkeypatch):
    """Closed after one result (the caller stopped), or interrupted (Ctrl-C): every worker
    is ended and waited for."""
    spec = EncoderSpec("bytes")
    batch = [({"text": f"example {i}"}, f"x:{i}") for i in range(50)]
    for how in ("close", "interrupt"):
        procs = spy_on_workers(monkeypatch)
        gen = encode_batches(spec, iter([batch] * 20), workers=2)
        items, examples = next(gen)
        assert [bytes(e.tokens.astype("u1")) for e in examples[:2]] == [b"example 0", b"example 1"]
        if how == "close":
            gen.close()
        else:
            with pytest.raises(KeyboardInterrupt):
                gen.throw(KeyboardInterrupt)
        assert len(procs) == 2 and all(p.returncode is not None for p in procs), how


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.slow
def test_workers_end_when_their_parent_is_killed(tmp_path):
    """The parent SIGKILLed (no clean-up runs): each worker reads the end of its stdin and exits."""
    script = tmp_path / "parent.py"
    script.write_text(
        textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(PKG).parent)!r})
        from fsdp_jax.app.data.encode_pool import EncoderSpec, _Pool
        pool = _Pool(EncoderSpec("bytes"), 2)
        i = pool.submit([({{"text": "hi"}}, "x:1")])
        assert pool.result(i)[0].tokens.tolist() == [104, 105]
        print(" ".join(str(p.pid) for p in pool.procs), flush=True)
        time.sleep(600)
    """)
    )
    parent = subprocess.Popen(
        [sys.executable, str(script)],
        stdout=subprocess.PIPE,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(Path(PKG).parent)),
    )
    try:
        pids = [int(p) for p in parent.stdout.readline().split()]
        assert len(pids) == 2 and all(_alive(p) for p in pids)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(p) for p in pids)
    finally:
        parent.kill()
        parent.wait()


def test_frames_round_trip_and_a_cut_frame_is_an_eof_error():
    import io

    buf = io.BytesIO()
    payloads = [b"", b"x", json.dumps({"a": [1, 2]}).encode(), bytes(range(256)) * 300]
    for p in payloads:
        encode_worker.write_frame(buf, p)
    whole = buf.getvalue()
    r = io.BytesIO(whole)
    assert [bytes(encode_worker.read_frame(r)) for _ in payloads] == payloads
    assert encode_worker.read_frame(r) is None
    for cut in (3, 8 + 1, len(whole) - 1):
        r = io.BytesIO(whole[:cut])
        with pytest.raises(EOFError):
            while encode_worker.read_frame(r) is not None:
                pass


class OfAnotherLibrary(Exception):
    pass


def test_a_workers_error_is_raised_as_its_class_with_its_message():
    from fsdp_jax.errors import DataError, ExampleError, TokenizerError

    table = [
        (ExampleError("a.jsonl:3: unknown role 'bot'"), ExampleError),
        (TokenizerError("tok: no EOS"), TokenizerError),
        (DataError("bad"), DataError),
        (KeyError("messages"), KeyError),
        (TypeError("can only concatenate str"), TypeError),
        (UnicodeEncodeError("utf-8", "\udcff", 0, 1, "surrogates not allowed"), UnicodeEncodeError),
        (ValueError(object()), ValueError),  # arguments JSON cannot carry: made from the message
        (OfAnotherLibrary("boom"), RuntimeError),
    ]  # a class the main process cannot name
    for e, cls in table:
        back = encode_pool._error(json.loads(encode_worker.error_reply(e)))
        assert type(back) is cls, (e, back)
        want = str(e) if cls is type(e) else f"an encoding worker failed: {type(e).__name__}: {e}"
        assert str(back) == want


def test_a_worker_that_cannot_start_is_one_oserror_with_its_last_line(monkeypatch):
    monkeypatch.setattr(
        encode_pool,
        "WORKER_ARGV",
        [sys.executable, "-c", "import sys; print('x'); sys.exit('no module named tokenizers')"],
    )
    procs = spy_on_workers(monkeypatch)
    batch = [({"text": "hi"}, "x:1")]
    with pytest.raises(
        OSError,
        match=r"^encoding worker [12] of 2 \(pid \d+\) exited with code 1: "
        r"no module named tokenizers$",
    ):
        list(encode_batches(EncoderSpec("bytes"), [batch] * 4, workers=2))
    assert len(procs) == 2 and all(p.returncode is not None for p in procs)
