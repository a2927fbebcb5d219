"""Hostile files, by class (issue #28): corpora whose token ids do not fit the model,
Hugging Face checkpoint directories (config.json keys, damaged safetensors, a missing
shard) and tokenizer files. Each case: one line on stderr naming the problem, exit code 2,
nothing written.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax.app import token_check
from fsdp_jax.app.data import DataError, prepare_bin
from helpers import TINY_RUN_OVERRIDES, call, one_line

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"


def listing(d: Path) -> list[str]:
    return sorted(str(p.relative_to(d)) for p in d.rglob("*")) if d.exists() else []


# -- token ids outside the model's vocabulary -------------------------------------------------------

def corpus_with(tmp_path: Path, name: str, train_ids, val_ids, vocab: int = 256, **meta_extra) -> Path:
    """A prepared corpus whose meta.json says `vocab`; `meta_extra` set in meta.json
    (max_token_id=None: the key removed, as in a corpus prepared before it existed)."""
    src = tmp_path / f"{name}_src"
    src.mkdir()
    np.asarray(train_ids, np.uint16).tofile(src / "t.bin")
    np.asarray(val_ids, np.uint16).tofile(src / "v.bin")
    out = tmp_path / name
    prepare_bin(src / "t.bin", src / "v.bin", out, vocab_size=vocab, check_tokens=False)
    meta = json.loads((out / "meta.json").read_text())
    for k, v in meta_extra.items():
        if v is None:
            meta.pop(k, None)
        else:
            meta[k] = v
    (out / "meta.json").write_text(json.dumps(meta))
    return out


def test_corpus_token_ids_outside_the_vocabulary_are_refused_before_anything_is_written(tmp_path, capsys,
                                                                                         monkeypatch):
    """Before: found batch by batch after config.yaml was written and the step compiled
    (and an id only in val.bin, or in a window no step drew, not at all)."""
    ok = np.arange(4000) % 200
    bad_val = np.concatenate([ok[:999], [300]])  # the last token of val.bin
    cases = {  # name: (corpus, words the line must hold)
        "old corpus, bad id in train": (corpus_with(tmp_path, "t", np.r_[ok, 256], ok[:1000], max_token_id=None),
                                        ["token id 256", "train.bin", "model.vocab_size=256"]),
        "old corpus, bad id last in val": (corpus_with(tmp_path, "v", ok, bad_val, max_token_id=None),
                                           ["token id 300", "val.bin", "model.vocab_size=256"]),
        "meta says 999": (corpus_with(tmp_path, "m", ok, ok[:1000], max_token_id=999),
                          ["token id 999", "meta.json", "model.vocab_size=256"]),
        "meta max_token_id not an id": (corpus_with(tmp_path, "n", ok, ok[:1000], max_token_id="lots"),
                                        ["meta.json", "max_token_id"]),
        "meta max_token_id negative": (corpus_with(tmp_path, "g", ok, ok[:1000], max_token_id=-1),
                                       ["meta.json", "max_token_id"]),
        "meta max_token_id a bool": (corpus_with(tmp_path, "b", ok, ok[:1000], max_token_id=True),
                                     ["meta.json", "max_token_id"]),
        "meta max_token_id a float": (corpus_with(tmp_path, "f", ok, ok[:1000], max_token_id=12.5),
                                      ["meta.json", "max_token_id"]),
    }
    scanned = []
    real_scan = token_check.scan_max_token_id
    monkeypatch.setattr(token_check, "scan_max_token_id", lambda *a, **k: scanned.append(a) or real_scan(*a, **k))
    run_dir = tmp_path / "run"
    for name, (corpus, words) in cases.items():
        before, scanned[:] = listing(corpus), []
        rc, out, err = call("train", "--config", TINY_YAML, "--no-progress", *TINY_RUN_OVERRIDES, "train.steps=2",
                            f"data.path={corpus}", f"run_dir={run_dir}", capsys=capsys)
        try:
            one_line(rc, err, "data.path" if "token id" in words[0] else "meta.json", str(corpus), *words)
        except AssertionError as e:
            raise AssertionError(f"{name}: {e}") from None
        assert not run_dir.exists(), (name, listing(run_dir))
        assert "compiled" not in out, name
        assert listing(corpus) == before
        assert bool(scanned) == name.startswith("old corpus"), name  # meta.json's key is trusted
    # an id in range: nothing to say; the key saves the scan
    good = corpus_with(tmp_path, "good", ok, ok[:1000], max_token_id=199)
    token_check.check_corpus_vocab(good, 200)
    with pytest.raises(DataError, match="token id 199 .meta.json. is outside model.vocab_size=199"):
        token_check.check_corpus_vocab(good, 199)
    assert not scanned


def test_the_scan_of_an_old_corpus_reads_every_chunk_with_a_progress_bar(tmp_path, monkeypatch, capsys):
    ids = np.arange(5000) % 100
    for pos in (0, 1023, 1024, 4999):  # chunk edges: first, last of one, first of the next, the end
        t = ids.copy()
        t[pos] = 777
        corpus = corpus_with(tmp_path, f"c{pos}", t, ids[:700], vocab=1000, max_token_id=None)
        monkeypatch.setattr(token_check, "CHUNK", 1024)
        monkeypatch.setattr(token_check, "BAR_FROM", 10**9)
        assert token_check.corpus_max_token_id(corpus, progress=True) == (777, "train.bin")
    monkeypatch.setattr(token_check, "BAR_FROM", 100)
    capsys.readouterr()
    assert token_check.corpus_max_token_id(corpus, progress=True) == (777, "train.bin")
    assert "checking token ids" in capsys.readouterr().err
    assert token_check.corpus_max_token_id(corpus, progress=False)[0] == 777
    assert "checking token ids" not in capsys.readouterr().err
