"""Packing (fsdp_jax.app.data.packing) and packed corpora (fsdp_jax.app.data.sft): best-fit
rows, segments and restarted positions, truncate/split counts, the streaming prepare
and its bad-input table, and batch order as a pure function of (seed, step)."""

import json
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax.app.data import packing
from fsdp_jax.app.data.packed_rows import make_packed_dataset, packed_eval_batches, row_indices
from fsdp_jax.app.data.sft import prepare_examples

ROOT = Path(__file__).resolve().parents[1]
CHAT = ROOT / "tests" / "golden" / "chat"


def prep_script():
    """`fsdp-jax prepare` (scripts/prepare.py is a shim over it)."""
    from fsdp_jax.app.cli import prepare

    return prepare


def ragged(n=4000, seed=0):
    """Lengths as in chat data: log-normal, median ~90, a long tail (clipped to a row)."""
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(4.5, 0.8, n).astype(int), 2, 1024).tolist()


def test_best_fit_fills_rows_on_a_ragged_set():
    lengths = ragged()
    rows = packing.fit(lengths, 1024)
    assert sorted(i for r in rows for i in r) == list(range(len(lengths)))  # each exactly once
    assert all(sum(lengths[i] for i in r) <= 1024 for r in rows)
    eff = sum(lengths) / (len(rows) * 1024)
    print(f"packing efficiency on {len(lengths)} ragged examples, rows of 1024: {eff:.4f}")
    assert eff >= 0.95
    assert len(rows) == -(-sum(lengths) // 1024) or eff >= 0.99  # near the lower bound


def test_pack_segments_positions_and_targets_stay_in_their_example():
    ex = [(np.arange(10, 15), np.array([0, 0, 1, 1, 1], np.uint8)), (np.arange(20, 23), np.array([0, 1, 1], np.uint8))]
    tok, msk, seg = packing.pack(ex, 10)
    assert tok.tolist() == [[10, 11, 12, 13, 14, 20, 21, 22, 0, 0]]
    assert seg.tolist() == [[1, 1, 1, 1, 1, 2, 2, 2, 0, 0]]
    b = packing.batch_from_rows(tok, msk, seg)
    assert b["positions"].tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0, 1]]
    # position i predicts token i+1 of its own example, trained when that token is masked in
    assert b["targets"][0, :4].tolist() == [11, 12, 13, 14]
    assert b["weights"].tolist() == [[0, 1, 1, 1, 0, 1, 1, 0, 0, 0]]


@pytest.mark.parametrize("overflow, rows, truncated, split, dropped", [("truncate", 1, 1, 0, 6), ("split", 2, 0, 1, 0)])
def test_overflow_is_counted(overflow, rows, truncated, split, dropped):
    stats = packing.PackStats()
    pieces = packing.cut(np.arange(16), np.ones(16, np.uint8), 10, overflow, stats)
    assert len(pieces) == rows and (stats.truncated, stats.split, stats.dropped_tokens) == (truncated, split, dropped)
    assert packing.cut(np.arange(16), np.zeros(16, np.uint8), 10, overflow, stats) == []
    assert stats.empty == 1


def test_document_mask_windows_restart_after_eos():
    w = np.array([[5, 6, 2, 7, 8, 2, 9]])
    b = packing.batch_from_windows(w, eos_id=2)
    assert b["segment_ids"].tolist() == [[1, 1, 1, 2, 2, 2]]
    assert b["positions"].tolist() == [[0, 1, 2, 0, 1, 2]]


def chats(path: Path, n: int, seed: int = 0) -> Path:
    rng = np.random.default_rng(seed)
    words = "the a cat dog sat ran on mat far home red blue".split()
    with open(path, "w") as f:
        for i in range(n):
            q = " ".join(rng.choice(words, int(rng.integers(1, 12))))
            a = " ".join(rng.choice(words, int(rng.integers(1, 20))))
            f.write(
                json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]}) + "\n"
            )
    return path


def test_prepare_examples_round_trip_and_efficiency(tmp_path):
    src = chats(tmp_path / "c.jsonl", 1500)
    meta = prepare_examples([src], tmp_path / "o", row_len=512, tokenizer=str(CHAT / "llama2"))
    print("packing report:", json.dumps(meta["packing"]))
    assert meta["format"] == "packed" and meta["packing"]["efficiency"] >= 0.95
    assert meta["max_token_id"] < meta["vocab_size"] and meta["examples"] == 1500
    assert meta["train_rows"] > 0 and meta["val_rows"] > 0
    # every example lands in exactly one row of one split
    segs = sum(
        int(np.fromfile(tmp_path / "o" / f"{s}.seg.bin", np.uint16).reshape(-1, 512).max(1).sum())
        for s in ("train", "val")
    )
    assert segs == 1500
    ev = packed_eval_batches(tmp_path / "o", 4, 1000)
    assert sum(int(b["weights"].sum()) for b in ev) == meta["val_trained_tokens"]


@pytest.mark.parametrize("procs", [1, 2, 4])
def test_order_is_a_pure_function_of_seed_and_step(tmp_path, procs):
    src = chats(tmp_path / "c.jsonl", 400)
    prepare_examples([src], tmp_path / "o", row_len=128, tokenizer=str(CHAT / "llama2"))
    one = make_packed_dataset(tmp_path / "o", "train", 8, seed=3)
    want = [next(one) for _ in range(6)]
    # N processes: their slices, concatenated, are the one-process batch, at every step
    its = [make_packed_dataset(tmp_path / "o", "train", 8, 3, p, procs) for p in range(procs)]
    for s in range(6):
        got = [next(it) for it in its]
        for k in want[s]:
            np.testing.assert_array_equal(np.concatenate([g[k] for g in got]), want[s][k])
    # resume at step 4 on a different number of processes
    resumed = make_packed_dataset(tmp_path / "o", "train", 8, 3, 0, 2)
    resumed.set_state({"step": 4})
    np.testing.assert_array_equal(next(resumed)["inputs"], want[4]["inputs"][:4])
    # an epoch visits every row once before any repeats
    n = len(np.fromfile(tmp_path / "o" / "train.seg.bin", np.uint16)) // 128
    seen = np.concatenate([row_indices(n, 8, 3, s) for s in range(n // 8)])
    assert len(set(seen.tolist())) == len(seen)


def test_prepare_bad_input_table(tmp_path, capsys):
    prep = prep_script()
    tpl_bad = tmp_path / "bad.jinja"
    tpl_bad.write_text(
        "{{ raise_exception('no system messages here') if messages[0].role == 'system' }}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    good = json.dumps({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]})
    empty = json.dumps({"messages": [{"role": "user", "content": "hi"}]})  # no assistant turn
    cases = [
        ("notjson", [good, "{not json"], [], ":2: not JSON"),
        ("norole", [good, json.dumps({"messages": [{"content": "x"}]})], [], ":2: message 0 needs"),
        ("nocontent", [json.dumps({"messages": [{"role": "user"}]})], [], ":1: message 0 needs"),
        (
            "role",
            [good, good, json.dumps({"messages": [{"role": "bot", "content": "x"}]})],
            [],
            ":3: message 0 has unknown role 'bot'",
        ),
        (
            "render",
            [
                good,
                json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}),
            ],
            ["--chat-template", str(tpl_bad)],
            ":2: the chat template fails to render",
        ),
        (
            "allempty",
            [
                empty,
                empty,
                json.dumps({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}),
            ],
            [],
            "no example has anything to train on: 3 of 3 examples have an empty loss mask (first: ",
        ),
        ("instruction", [json.dumps({"prompt": 1, "completion": "x"})], [], ":1: an instruction needs"),
    ]
    for name, lines, extra, want in cases:
        src = tmp_path / f"{name}.jsonl"
        src.write_text("\n".join(lines) + "\n")
        out = tmp_path / f"out_{name}"
        rc = prep.main(
            ["--out", str(out), str(src), "--pack", "64", "--no-progress", "--tokenizer", str(CHAT / "llama2"), *extra]
        )
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1, (name, err)
        assert want in err and f"{name}.jsonl" in err, (name, err)
        assert not out.exists(), name
    for argv, want in [
        (["--threads", "-3"], "--threads: -3 is invalid"),
        (["--pack", "1"], "--pack: 1 is invalid"),
        (["--overflow", "split"], "need --pack"),
    ]:
        src = tmp_path / "notjson.jsonl"
        rc = prep.main(["--out", str(tmp_path / "o2"), str(src), *argv])
        err = capsys.readouterr().err
        assert rc == 2 and want in err and err.count("\n") == 1, (argv, err)


def test_empty_examples_are_counted_and_reported(tmp_path, capsys):
    good = [
        json.dumps(
            {"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": "yes " * (i % 7 + 1)}]}
        )
        for i in range(60)
    ]
    empty = json.dumps({"messages": [{"role": "user", "content": "hi"}]})
    src = tmp_path / "mixed.jsonl"
    src.write_text("\n".join(good[:30] + [empty, empty] + good[30:]) + "\n")
    rc = prep_script().main(
        [
            "--out",
            str(tmp_path / "o"),
            str(src),
            "--pack",
            "64",
            "--no-progress",
            "--tokenizer",
            str(CHAT / "llama2"),
            "--val-fraction",
            "0.2",
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0 and "skipped (nothing to train on) 2, first at" in out and "mixed.jsonl:31" in out
    meta = json.loads((tmp_path / "o" / "meta.json").read_text())
    assert meta["empty_skipped"] == 2 and meta["examples"] == 62


def test_document_mask_config_on_token_corpora(tmp_path):
    from fsdp_jax.app.config.checks import check_data
    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.data import corpus as data
    from fsdp_jax.app.data.batches import make_batches
    from fsdp_jax.errors import ConfigError

    src = tmp_path / "d.jsonl"
    src.write_text("\n".join(json.dumps({"text": f"doc {i} " + "word " * (i % 9 + 1)}) for i in range(80)))
    data.prepare_text([src], tmp_path / "tok", val_fraction=0.1, tokenizer=str(CHAT / "llama2"))
    data.prepare_text([src], tmp_path / "bytes", val_fraction=0.1)
    over = [
        "data.seq_len=32",
        "train.global_batch=4",
        "data.document_mask=true",
        "data.source=none",
        "model.max_seq_len=32",
    ]
    cfg = load_config(ROOT / "configs" / "tiny.yaml", over + [f"data.path={tmp_path / 'tok'}"])
    check_data(cfg)
    train, val = make_batches(cfg, 0, 1)
    b = next(train)
    eos = json.loads((tmp_path / "tok" / "meta.json").read_text())["eos_id"]
    for r in range(4):
        ends = np.flatnonzero(b["inputs"][r] == eos)
        assert len(ends) and (b["positions"][r][ends[:-1] + 1] == 0).all()  # restart after each EOS
        assert (np.diff(b["segment_ids"][r]) == (b["inputs"][r][:-1] == eos)).all()
    with pytest.raises(ConfigError, match="data.document_mask.*EOS"):
        check_data(load_config(ROOT / "configs" / "tiny.yaml", over + [f"data.path={tmp_path / 'bytes'}"]))
    packed = tmp_path / "packed"
    prepare_examples([chats(tmp_path / "c.jsonl", 200)], packed, row_len=64, tokenizer=str(CHAT / "llama2"))
    with pytest.raises(ConfigError, match="data.seq_len.*row length 64"):
        check_data(
            load_config(ROOT / "configs" / "tiny.yaml", ["data.seq_len=32", f"data.path={packed}", "data.source=none"])
        )


def test_a_killed_prepare_leaves_the_previous_corpus_and_the_next_run_cleans_up(tmp_path, monkeypatch):
    import subprocess
    import sys

    from fsdp_jax.app.data import corpus as data
    from fsdp_jax.app.data import sft as sft_data
    from fsdp_jax.app.data.examples import ExampleEncoder

    src = chats(tmp_path / "c.jsonl", 300)
    out = tmp_path / "o"
    before = prepare_examples([src], out, row_len=128, tokenizer=str(CHAT / "llama2"))
    files = {f.name: f.read_bytes() for f in out.iterdir()}
    # a run that dies mid-stream (after writing rows): the previous corpus stays complete
    monkeypatch.setattr(sft_data, "BATCH_BYTES", 2000)
    calls = {"n": 0}
    real = ExampleEncoder.encode_batch

    def dying(self, items, threads=None):
        calls["n"] += 1
        if calls["n"] == 3:
            raise KeyboardInterrupt  # as a kill would stop it, mid-stream
        return real(self, items, threads)

    monkeypatch.setattr(ExampleEncoder, "encode_batch", dying)
    with pytest.raises(KeyboardInterrupt):
        prepare_examples([src], out, row_len=64, tokenizer=str(CHAT / "llama2"))
    assert data.load_meta(out) == before and {f.name: f.read_bytes() for f in out.iterdir()} == files
    # SIGKILL leaves temporary files of a dead process; the next run removes them
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    ).stdout.strip()
    (out / f".train.bin.tmp.{dead}").write_bytes(b"partial")
    monkeypatch.setattr(ExampleEncoder, "encode_batch", real)
    after = prepare_examples([src], out, row_len=64, tokenizer=str(CHAT / "llama2"))
    assert after["row_len"] == 64 and not list(out.glob(".*.tmp.*"))
