"""Preference rows -> token pairs as TRL's DPOTrainer makes them (goldens from its own
`_prepare_dataset`, tests/golden/make_preference_goldens.py --data), its collator's
truncation, and bad rows in one line."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax.app.data.examples import find_chat_template, special_tokens
from fsdp_jax.app.data.tokenizer import load_tokenizer
from fsdp_jax.app.objectives.preference_data import (
    PairEncoder,
    PairIds,
    PreferenceKeys,
    PreferenceReport,
    collate,
    read_pairs,
)
from fsdp_jax.errors import DataError

GOLDEN = Path(__file__).parent / "golden"
DATA = json.loads((GOLDEN / "preference" / "data_goldens.json").read_text())


def llama3_encoder() -> PairEncoder:
    d = GOLDEN / "chat" / "llama3"
    return PairEncoder(load_tokenizer(d), find_chat_template(d), special_tokens(d))


def test_rows_tokenize_as_trl(tmp_path):
    f = tmp_path / "prefs.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in DATA["rows"]))
    pairs, wheres, report = read_pairs([f], llama3_encoder())
    for got, want in zip(pairs, DATA["ids"]):
        assert (got.prompt, got.chosen, got.rejected) == (want["prompt_ids"], want["chosen_ids"], want["rejected_ids"])
    assert wheres == [f"{f}:1", f"{f}:2", f"{f}:3"]
    assert report.pairs == 3 and report.conversational == 2 and report.prefix_mismatch == 0


def test_mapped_keys_and_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    rows = [{"q": "The sky is", "good": " blue.", "bad": " green."}]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "p.parquet")
    pairs, _, _ = read_pairs([tmp_path / "p.parquet"], llama3_encoder(), PreferenceKeys("q", "good", "bad"))
    want = DATA["ids"][0]
    assert (pairs[0].prompt, pairs[0].chosen, pairs[0].rejected) == tuple(
        want[k] for k in ("prompt_ids", "chosen_ids", "rejected_ids")
    )


def test_collate_truncates_as_trl_and_counts():
    pairs = [PairIds([1, 2, 3], [4, 5], [6]), PairIds([7, 8], [9, 10, 11, 12], [13])]
    report = PreferenceReport()
    out = collate(pairs, 6, max_length=5, report=report)
    assert out["tokens"].shape == (2, 2, 6)
    assert out["tokens"][1, 0].tolist() == [7, 8, 9, 10, 11, 0]  # keep_start: the first 5
    assert out["completion"][1, 0].tolist() == [0, 0, 1, 1, 1, 0]
    assert out["attention"][0, 1].tolist() == [1, 1, 1, 1, 0, 0]
    assert report.truncated == 1 and report.max_row == 6
    end = collate(pairs, 6, max_length=5, truncation="keep_end")
    assert end["tokens"][1, 0].tolist() == [8, 9, 10, 11, 12, 0]
    with pytest.raises(DataError, match="fills the whole row"):
        collate([PairIds([1] * 5, [2], [3])], 8, max_length=5, wheres=["x.jsonl:4"])


@pytest.mark.parametrize(
    "row, words",
    [
        ({"prompt": "a", "chosen": "b"}, 'no "rejected"'),
        ({"prompt": "a", "rejected": "b"}, 'no "chosen"'),
        ({"prompt": "a", "chosen": "", "rejected": "b"}, "chosen completion is empty"),
        ({"prompt": "a", "chosen": ["x"], "rejected": "b"}, "rejected"),
        ([1, 2], "JSON object"),
    ],
)
def test_bad_rows_one_line(tmp_path, row, words):
    f = tmp_path / "bad.jsonl"
    f.write_text(json.dumps({"prompt": "p", "chosen": "c", "rejected": "r"}) + "\n" + json.dumps(row) + "\n")
    with pytest.raises(DataError) as e:
        read_pairs([f], PairEncoder())
    msg = str(e.value)
    assert "\n" not in msg and f"{f}:2" in msg and words in msg


def test_identical_pairs_are_counted(tmp_path):
    f = tmp_path / "same.jsonl"
    f.write_text(json.dumps({"prompt": "p", "chosen": "c", "rejected": "c"}) + "\n")
    pairs, _, report = read_pairs([f], PairEncoder())
    assert report.identical == 1 and pairs[0].chosen == list(b"c")
    assert np.asarray(collate(pairs, 4)["completion"]).sum() == 2
