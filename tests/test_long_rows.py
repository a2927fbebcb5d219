"""Packed fine-tuning rows of 65536 tokens or more (long context): `prepare --pack 131072`
writes uint32 segment ids (meta.json `seg_dtype`), the trainer's config and batches read
them back, and corpora written before `seg_dtype` existed (uint16, no key) still load."""

import json
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax.app.cli import prepare
from fsdp_jax.app.data import corpus as data
from fsdp_jax.app.data.packed_rows import PackedRows, make_packed_dataset, row_indices
from fsdp_jax.app.data.sft import prepare_examples
from fsdp_jax.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
ROW = 131072
SHORT, LONG, LONG_LEN = 140_000, 3, 70_000  # 2-byte texts fill a row with 65536 examples


def _long_corpus(tmp_path: Path) -> Path:
    src = tmp_path / "long.jsonl"
    recs = [{"text": "ab"}] * SHORT + [{"text": "x" * LONG_LEN}] * LONG
    src.write_text("\n".join(json.dumps(r) for r in recs) + "\n")
    return src


def _all_rows(out: Path, split: str) -> dict[str, np.ndarray]:
    rows = PackedRows(out, split)
    return rows.batch(np.arange(len(rows)))


@pytest.mark.slow
def test_prepare_rows_of_131072_tokens_end_to_end(tmp_path, capsys):
    from fsdp_jax.app.config.checks import check_data
    from fsdp_jax.app.config.parse import load_config
    from fsdp_jax.app.data.batches import make_batches

    out = tmp_path / "o"
    rc = prepare.main(["--out", str(out), str(_long_corpus(tmp_path)), "--pack", str(ROW), "--no-progress"])
    assert rc == 0, capsys.readouterr().err
    meta = data.load_meta(out)
    assert meta["row_len"] == ROW and meta["seg_dtype"] == "uint32" and meta["examples"] == SHORT + LONG
    assert (out / "train.seg.bin").stat().st_size == 4 * meta["train_tokens"]
    per_split = {s: _all_rows(out, s) for s in ("train", "val")}
    # every example in exactly one row: a row's largest id is its example count
    assert sum(int(b["segment_ids"].max(1).sum()) for b in per_split.values()) == SHORT + LONG
    train = per_split["train"]
    assert int(train["segment_ids"].max()) == ROW // 2  # 65536: past uint16
    # each 2-byte text trains its second byte, a long one all but its first
    trained = sum(float(b["weights"].sum()) for b in per_split.values())
    assert trained == SHORT + LONG * (LONG_LEN - 1) == meta["train_trained_tokens"] + meta["val_trained_tokens"]
    seg, pos = train["segment_ids"], train["positions"]
    starts = np.ones(seg.shape, bool)
    starts[:, 1:] = seg[:, 1:] != seg[:, :-1]
    assert ((pos == 0) == starts).all() and int(pos[seg > 0].max()) == LONG_LEN - 1
    cfg = load_config(
        ROOT / "configs" / "tiny.yaml",
        [f"data.seq_len={ROW}", f"model.max_seq_len={ROW}", f"data.path={out}", "data.source=none"]
        + ["train.global_batch=2", "train.eval_every=0"],
    )
    check_data(cfg)
    it, val = make_batches(cfg, 0, 1)
    b = next(it)
    assert b["inputs"].shape == (2, ROW) and b["segment_ids"].dtype == np.int32 and val == []
    idx = row_indices(len(seg), 2, cfg.data.seed, 0)
    for k in b:
        np.testing.assert_array_equal(b[k], train[k][idx])


def test_rows_over_the_limit_are_refused(tmp_path, capsys):
    src = tmp_path / "a.jsonl"
    src.write_text(json.dumps({"text": "ab"}) + "\n")
    rc = prepare.main(["--out", str(tmp_path / "o"), str(src), "--pack", str((1 << 24) + 1), "--no-progress"])
    err = capsys.readouterr().err
    assert rc == 2 and "--pack 16777217: must be in 2..16777216" in err and err.count("\n") == 1
    with pytest.raises(DataError, match="row length 16777217: must be in 2..16777216"):
        prepare_examples([src], tmp_path / "o", row_len=(1 << 24) + 1)


def _short_corpus(tmp_path: Path) -> Path:
    src = tmp_path / "s.jsonl"
    src.write_text("\n".join(json.dumps({"text": "word " * (i % 13 + 1)}) for i in range(300)) + "\n")
    out = tmp_path / "short"
    meta = prepare_examples([src], out, row_len=64)
    assert meta["seg_dtype"] == "uint16" and (out / "train.seg.bin").stat().st_size == 2 * meta["train_tokens"]
    return out


def _set_meta(out: Path, **kv) -> None:
    meta = json.loads((out / "meta.json").read_text())
    for k, v in kv.items():
        if v is None:
            meta.pop(k)
        else:
            meta[k] = v
    (out / "meta.json").write_text(json.dumps(meta))


def test_corpora_without_seg_dtype_load_as_uint16(tmp_path):
    out = _short_corpus(tmp_path)
    want = [next(it) for it in [make_packed_dataset(out, "train", 4, seed=1)] for _ in range(3)]
    _set_meta(out, seg_dtype=None)  # as written before seg_dtype existed
    assert "seg_dtype" not in data.load_meta(out) and PackedRows(out, "train").seg.dtype == np.uint16
    it = make_packed_dataset(out, "train", 4, seed=1)
    for w in want:
        got = next(it)
        for k in w:
            np.testing.assert_array_equal(got[k], w[k])


@pytest.mark.parametrize(
    "seg, want", [("uint32", "train.seg.bin'?: missing or not \\d+ uint32 values"), ("int8", "seg_dtype 'int8'")]
)
def test_a_seg_dtype_that_does_not_match_the_files_is_refused(tmp_path, seg, want):
    out = _short_corpus(tmp_path)
    _set_meta(out, seg_dtype=seg)
    with pytest.raises(DataError, match=want):
        data.load_meta(out)
