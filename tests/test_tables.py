"""Tables as prepare sources (fsdp_jax.app.data.tables): .parquet files and Hugging Face `datasets`
directories (tests/golden/datasets/, written by `datasets` itself: make_dataset_goldens.py),
with key mapping, read a batch at a time; they give the corpus the same records as .jsonl
give, and bad ones are one line, exit 2."""

import json
from pathlib import Path

import numpy as np
import pytest

from helpers import call

pa = pytest.importorskip("pyarrow")
import pyarrow.parquet as pq  # noqa: E402

from fsdp_jax.app.data.tables import table_rows  # noqa: E402

GOLDEN = Path(__file__).resolve().parent / "golden"
DATASETS = GOLDEN / "datasets"
RECORDS = json.loads((DATASETS / "records.json").read_text())
LLAMA32 = GOLDEN / "chat_families" / "llama32"  # renders tool calls and tool turns


def corpus(d: Path) -> dict:
    meta = json.loads((d / "meta.json").read_text())
    files = sorted(p.name for p in d.iterdir() if p.suffix == ".bin")
    return {"meta": {k: meta[k] for k in ("examples", "kinds", "train_rows", "val_rows") if k in meta}} | {
        f: (d / f).read_bytes() for f in files
    }


def prepare(capsys, *args):
    code, out, err = call("prepare", *map(str, args), "--no-progress", capsys=capsys)
    return code, out, err


def as_jsonl(path: Path, rows, rename=None) -> Path:
    with open(path, "w") as f:
        for r in rows:
            r = {rename.get(k, k): v for k, v in r.items()} if rename else r
            f.write(json.dumps(r) + "\n")
    return path


def test_datasets_directory_of_openai_chats_is_the_same_corpus_as_their_jsonl(tmp_path, capsys, monkeypatch):
    from fsdp_jax.app.data import chat_template

    monkeypatch.setattr(chat_template, "_now", lambda: __import__("datetime").datetime(2026, 1, 15))
    pack = ["--pack", 160, "--tokenizer", LLAMA32]
    code, _, err = prepare(
        capsys, DATASETS / "chats", "--out", tmp_path / "a", *pack, "--messages-key", "conversations"
    )
    assert code == 0, err
    src = as_jsonl(tmp_path / "chats.jsonl", RECORDS["chats"], {"conversations": "messages"})
    code, _, err = prepare(capsys, src, "--out", tmp_path / "b", *pack)
    assert code == 0, err
    a, b = corpus(tmp_path / "a"), corpus(tmp_path / "b")
    assert a == b and a["meta"]["examples"] == 40 and a["meta"]["kinds"] == {"chat": 40}
    assert json.loads((tmp_path / "a" / "meta.json").read_text())["keys"]["messages"] == "conversations"


def test_parquet_instructions_with_mapped_columns_equal_their_jsonl(tmp_path, capsys):
    pq.write_table(pa.Table.from_pylist(RECORDS["qa"]), tmp_path / "qa.parquet", row_group_size=7)
    keys = ["--prompt-key", "question", "--completion-key", "answer"]
    code, _, err = prepare(capsys, tmp_path / "qa.parquet", "--out", tmp_path / "a", "--pack", 32, *keys)
    assert code == 0, err
    src = as_jsonl(tmp_path / "qa.jsonl", RECORDS["qa"], {"question": "prompt", "answer": "completion"})
    assert prepare(capsys, src, "--out", tmp_path / "b", "--pack", 32)[0] == 0
    assert corpus(tmp_path / "a") == corpus(tmp_path / "b")
    assert corpus(tmp_path / "a")["meta"]["kinds"] == {"instruction": 30}


@pytest.mark.parametrize("tokenizer", ["bytes", str(GOLDEN / "hf" / "llama_gqa")], ids=["bytes", "hf-llama_gqa"])
def test_a_text_column_is_a_pretraining_corpus_like_jsonl_text(tmp_path, capsys, tokenizer):
    rows = [{"body": f"document {i}: " + "words " * (i % 9), "n": i} for i in range(60)]
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "t.parquet", row_group_size=16)
    tok = ["--tokenizer", tokenizer]
    code, _, err = prepare(capsys, tmp_path / "t.parquet", "--out", tmp_path / "a", "--text-key", "body", *tok)
    assert code == 0, err
    src = as_jsonl(tmp_path / "t.jsonl", [{"text": r["body"]} for r in rows])
    assert prepare(capsys, src, "--out", tmp_path / "b", *tok)[0] == 0
    for f in ("train.bin", "val.bin"):
        assert (tmp_path / "a" / f).read_bytes() == (tmp_path / "b" / f).read_bytes()


def test_rows_are_read_a_batch_at_a_time(tmp_path):
    text = "x" * 1000
    pq.write_table(pa.Table.from_pylist([{"text": text}] * 20_000), tmp_path / "big.parquet", row_group_size=1000)
    pool = pa.default_memory_pool()
    base = pool.bytes_allocated()
    peak = 0
    for n, row in table_rows(tmp_path / "big.parquet"):
        assert row["text"] == text
        if n % 500 == 0:
            peak = max(peak, pool.bytes_allocated() - base)
    assert n == 20_000 and peak < 4 << 20  # the table holds 20 MB of text: about one row group lives at a time


def _bad_sources(tmp):
    (tmp / "int.jsonl").write_text('{"text": "fine"}\n{"text": 5}\n')
    pq.write_table(pa.Table.from_pylist([{"text": 1}, {"text": 2}]), tmp / "int.parquet")
    (tmp / "broken.parquet").write_bytes(b"PAR1 this is not parquet PAR1")
    return tmp


@pytest.mark.parametrize(
    "source, extra, match",
    [
        ("int.jsonl", [], r'int.jsonl:2: expected a JSON object with a "text" string \(a int\)'),
        ("int.jsonl", ["--tokenizer", str(GOLDEN / "hf" / "llama_gqa")], r'int.jsonl:2: .*"text" string \(a int\)'),
        ("int.jsonl", ["--pack", "16"], r'int.jsonl:2: expected "messages", "prompt"\+"completion" or a "text" string'),
        ("int.parquet", [], r'int.parquet:1: expected a JSON object with a "text" string \(a int\)'),
        ("broken.parquet", ["--pack", "16"], r"broken.parquet: not a readable parquet file"),
        ("broken.parquet", [], r"broken.parquet: not a readable parquet file"),
        (
            str(DATASETS / "qa_dict"),
            ["--pack", "16"],
            r"qa_dict: a DatasetDict of splits train, test; give one split: ",
        ),
        (str(DATASETS / "qa"), ["--pack", "16", "--text-key", "nope"], r'qa:1: none of the keys "messages", "nope"'),
        (
            str(DATASETS / "qa"),
            ["--messages-key", "m"],
            r"--messages-key, --prompt-key and --completion-key need --pack",
        ),
        (str(DATASETS / "qa"), ["--text-key", " "], r"--text-key ' ': must name a key"),
    ],
)
def test_bad_tables_and_values_are_one_line_exit_2_nothing_written(tmp_path, capsys, source, extra, match):
    src = _bad_sources(tmp_path) / source if "/" not in source else Path(source)
    code, out, err = prepare(capsys, src, "--out", tmp_path / "out", *extra)
    assert code == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert __import__("re").search(match, err), err
    assert not (tmp_path / "out").exists()


def test_a_table_without_pyarrow_says_how_to_install_it(tmp_path, capsys, monkeypatch):
    from fsdp_jax.app import extras

    monkeypatch.setattr(extras, "available", lambda m: m != "pyarrow")
    code, _, err = prepare(capsys, DATASETS / "qa", "--out", tmp_path / "o", "--pack", 16)
    assert code == 1 and "pip install 'fsdp_jax[data]'" in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "o").exists()


def test_datasets_rows_read_back_as_datasets_wrote_them():
    got = [row for _, row in table_rows(DATASETS / "chats")]
    assert got == RECORDS["chats"]
    assert np.all([r["conversations"][0]["tool_calls"] is None for r in got])  # Arrow fills the missing field


def test_a_datasets_directory_inside_a_source_directory_is_read_as_a_table(tmp_path, capsys):
    import shutil

    shutil.copytree(DATASETS / "qa", tmp_path / "src" / "qa")
    keys = ["--prompt-key", "question", "--completion-key", "answer"]
    code, _, err = prepare(capsys, tmp_path / "src", "--out", tmp_path / "a", "--pack", 32, *keys)
    assert code == 0, err
    assert corpus(tmp_path / "a")["meta"]["kinds"] == {"instruction": 30}  # not its files read as text
