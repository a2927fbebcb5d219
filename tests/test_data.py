"""Corpus preparation, the resumable batch iterator, and per-process slicing."""

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax.app.data import corpus as data
from fsdp_jax.app.data.windows import eval_batches, make_dataset

SCRIPT = Path(__file__).parent.parent / "scripts" / "prepare.py"


@pytest.fixture
def corpus(tmp_path):
    """20 text files, each a distinct repeated marker line, plus one non-UTF-8 file."""
    src = tmp_path / "src"
    (src / "sub").mkdir(parents=True)
    for i in range(20):
        (src / ("sub" if i % 2 else ".") / f"f{i:02d}.txt").write_text(f"file {i:02d} says hi\n" * 50)
    (src / "latin1.txt").write_bytes(bytes(range(256)) * 4)
    (src / "skip.md").write_text("not matched by *.txt")
    (src / ".hidden").mkdir()
    (src / ".hidden" / "h.txt").write_text("hidden")
    out = tmp_path / "out"
    meta = data.prepare_text([src], out, val_fraction=0.2, seed=1, pattern="*.txt")
    return src, out, meta


def test_prepare_meta_and_files(corpus):
    src, out, meta = corpus
    sizes = [f.stat().st_size for f in src.rglob("*.txt") if ".hidden" not in f.parts]
    assert meta == json.loads((out / "meta.json").read_text())
    assert meta["vocab_size"] == 256 and meta["dtype"] == "uint16" and meta["tokenizer"] == "bytes"
    assert meta["train_tokens"] + meta["val_tokens"] == sum(sizes)
    assert 0.2 * sum(sizes) <= meta["val_tokens"] < 0.2 * sum(sizes) + max(sizes)
    assert meta["split"] == "files" and meta["train_files"] + meta["val_files"] == 21
    assert (out / "train.bin").stat().st_size == 2 * meta["train_tokens"]
    assert data.load_meta(out) == meta
    assert not list(out.glob(".*tmp*"))


def test_val_files_are_unseen_in_train(corpus):
    src, out, meta = corpus
    train = np.fromfile(out / "train.bin", np.uint16).astype(np.uint8).tobytes()
    val = np.fromfile(out / "val.bin", np.uint16).astype(np.uint8).tobytes()
    seen_in_val = [i for i in range(20) if f"file {i:02d} says".encode() in val]
    assert seen_in_val and len(seen_in_val) < 20
    for i in range(20):
        assert (f"file {i:02d} says".encode() in train) != (i in seen_in_val)
    assert b"hidden" not in train + val and b"not matched" not in train + val


def test_prepare_is_deterministic_and_seeded(corpus, tmp_path):
    src, out, meta = corpus
    again = data.prepare_text([src], tmp_path / "again", val_fraction=0.2, seed=1, pattern="*.txt")
    assert (tmp_path / "again" / "val.bin").read_bytes() == (out / "val.bin").read_bytes()
    assert again["val_tokens"] == meta["val_tokens"]
    data.prepare_text([src], tmp_path / "other", val_fraction=0.2, seed=2, pattern="*.txt")
    assert (tmp_path / "other" / "val.bin").read_bytes() != (out / "val.bin").read_bytes()


def test_single_file_splits_by_bytes(tmp_path):
    f = tmp_path / "one.txt"
    f.write_bytes(b"abcdefghij" * 100)
    meta = data.prepare_text([f], tmp_path / "o", val_fraction=0.1)
    assert meta["split"] == "bytes" and (meta["train_tokens"], meta["val_tokens"]) == (900, 100)


def test_bad_inputs(tmp_path):
    with pytest.raises(data.DataError, match="not found"):
        data.prepare_text([tmp_path / "missing"], tmp_path / "o")
    (tmp_path / "empty").mkdir()
    with pytest.raises(data.DataError, match="empty corpus"):
        data.prepare_text([tmp_path / "empty"], tmp_path / "o")
    with pytest.raises(data.DataError, match="val_fraction"):
        data.prepare_text([SCRIPT], tmp_path / "o", val_fraction=1.5)
    with pytest.raises(data.DataError, match="meta.json not found"):
        data.load_meta(tmp_path / "empty")


def test_truncated_bin_is_detected(corpus):
    _, out, meta = corpus
    with open(out / "train.bin", "r+b") as f:
        f.truncate(10)
    with pytest.raises(data.DataError, match="train.bin"):
        data.load_meta(out)


def test_batches_shape_dtype_and_content(corpus):
    _, out, meta = corpus
    it = make_dataset(out, "train", seq_len=16, global_batch=8, seed=0)
    b = next(it)
    assert b.shape == (8, 17) and b.dtype == np.int32
    tokens = np.fromfile(out / "train.bin", np.uint16)
    row = b[3]
    starts = [i for i in range(len(tokens) - 16) if np.array_equal(tokens[i : i + 17], row)]
    assert starts, "each row is a contiguous window of train.bin"


def test_batches_deterministic_by_seed_and_step(corpus):
    _, out, _ = corpus
    a = make_dataset(out, "train", 16, 8, seed=0)
    b = make_dataset(out, "train", 16, 8, seed=0)
    c = make_dataset(out, "train", 16, 8, seed=1)
    a0, a1 = next(a), next(a)
    assert np.array_equal(a0, next(b)) and np.array_equal(a1, next(b))
    assert not np.array_equal(a0, a1)
    assert not np.array_equal(a0, next(c))
    assert np.array_equal(a.batch(1), a1)


def test_state_restore_resumes_exactly(corpus):
    _, out, _ = corpus
    ref = make_dataset(out, "train", 16, 8, seed=3)
    expected = [next(ref) for _ in range(6)]
    it = make_dataset(out, "train", 16, 8, seed=3)
    for _ in range(3):
        next(it)
    state = json.loads(json.dumps(it.get_state()))
    assert state == {"step": 3}
    fresh = make_dataset(out, "train", 16, 8, seed=3)
    fresh.set_state(state)
    for want in expected[3:]:
        assert np.array_equal(next(fresh), want)
    with pytest.raises(data.DataError):
        fresh.set_state({"step": "x"})


def test_process_slices_concatenate_to_global_batch(corpus):
    _, out, _ = corpus
    single = make_dataset(out, "train", 16, 8, seed=0)
    parts = [make_dataset(out, "train", 16, 8, seed=0, process_index=i, process_count=2) for i in range(2)]
    for _ in range(3):
        glob = next(single)
        halves = [next(p) for p in parts]
        assert halves[0].shape == (4, 17)
        assert np.array_equal(np.concatenate(halves), glob)
    with pytest.raises(data.DataError, match="divisible"):
        make_dataset(out, "train", 16, 8, seed=0, process_index=0, process_count=3)


def test_eval_batches_fixed_and_from_val(corpus):
    _, out, _ = corpus
    ev = eval_batches(out, 16, batch=4, n_batches=3, seed=0)
    assert len(ev) == 3 and all(b.shape == (4, 17) and b.dtype == np.int32 for b in ev)
    again = eval_batches(out, 16, batch=4, n_batches=3, seed=0)
    assert all(np.array_equal(x, y) for x, y in zip(ev, again))
    halves = [eval_batches(out, 16, 4, 3, 0, process_index=i, process_count=2) for i in range(2)]
    assert np.array_equal(np.concatenate([halves[0][1], halves[1][1]]), ev[1])
    val = np.fromfile(out / "val.bin", np.uint16).tobytes()
    assert ev[0][0].astype(np.uint16).tobytes() in val


def test_window_longer_than_split_is_an_error(corpus):
    _, out, meta = corpus
    with pytest.raises(data.DataError, match="fewer than one window"):
        make_dataset(out, "val", meta["val_tokens"] + 5, 2, seed=0)


def test_prepare_bin_pretokenized(tmp_path):
    rng = np.random.default_rng(0)
    tr, va = tmp_path / "tr.bin", tmp_path / "va.bin"
    rng.integers(0, 32000, 5000).astype(np.uint16).tofile(tr)
    rng.integers(0, 32000, 500).astype(np.uint16).tofile(va)
    meta = data.prepare_bin(tr, va, tmp_path / "c", vocab_size=32000)
    assert (meta["dtype"], meta["train_tokens"], meta["val_tokens"]) == ("uint16", 5000, 500)
    assert data.load_meta(tmp_path / "c") == meta
    assert next(make_dataset(tmp_path / "c", "train", 32, 4, 0)).max() < 32000
    big = tmp_path / "big.bin"
    np.array([1, 70000, 3], np.uint32).tofile(big)
    assert data.prepare_bin(big, big, tmp_path / "d", vocab_size=100000)["dtype"] == "uint32"
    with pytest.raises(data.DataError, match="token id 70000 >= vocab_size"):
        data.prepare_bin(big, big, tmp_path / "e", vocab_size=50000, dtype="uint32")
    with pytest.raises(data.DataError, match="does not fit"):
        data.prepare_bin(tr, va, tmp_path / "f", vocab_size=100000, dtype="uint16")


def _run(*args):
    return subprocess.run([sys.executable, str(SCRIPT), *map(str, args)], capture_output=True, text=True, timeout=60)


@pytest.mark.slow
def test_script_writes_corpus(corpus, tmp_path):
    src, _, _ = corpus
    r = _run("--out", tmp_path / "s", src, "--pattern", "*.txt", "--val-fraction", "0.2")
    assert r.returncode == 0, r.stderr
    assert data.load_meta(tmp_path / "s")["val_fraction"] == 0.2
