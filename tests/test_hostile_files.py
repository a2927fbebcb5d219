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

from fsdp_jax.app.data import token_check
from fsdp_jax.app.data.corpus import prepare_bin
from fsdp_jax.errors import DataError
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


def test_corpus_token_ids_outside_the_vocabulary_are_refused_before_anything_is_written(tmp_path, capsys, monkeypatch):
    """Before: found batch by batch after config.yaml was written and the step compiled
    (and an id only in val.bin, or in a window no step drew, not at all)."""
    ok = np.arange(4000) % 200
    bad_val = np.concatenate([ok[:999], [300]])  # the last token of val.bin
    cases = {  # name: (corpus, words the line must hold)
        "old corpus, bad id in train": (
            corpus_with(tmp_path, "t", np.r_[ok, 256], ok[:1000], max_token_id=None),
            ["token id 256", "train.bin", "model.vocab_size=256"],
        ),
        "old corpus, bad id last in val": (
            corpus_with(tmp_path, "v", ok, bad_val, max_token_id=None),
            ["token id 300", "val.bin", "model.vocab_size=256"],
        ),
        "meta says 999": (
            corpus_with(tmp_path, "m", ok, ok[:1000], max_token_id=999),
            ["token id 999", "meta.json", "model.vocab_size=256"],
        ),
        "meta max_token_id not an id": (
            corpus_with(tmp_path, "n", ok, ok[:1000], max_token_id="lots"),
            ["meta.json", "max_token_id"],
        ),
        "meta max_token_id negative": (
            corpus_with(tmp_path, "g", ok, ok[:1000], max_token_id=-1),
            ["meta.json", "max_token_id"],
        ),
        "meta max_token_id a bool": (
            corpus_with(tmp_path, "b", ok, ok[:1000], max_token_id=True),
            ["meta.json", "max_token_id"],
        ),
        "meta max_token_id a float": (
            corpus_with(tmp_path, "f", ok, ok[:1000], max_token_id=12.5),
            ["meta.json", "max_token_id"],
        ),
    }
    scanned = []
    real_scan = token_check.scan_max_token_id
    monkeypatch.setattr(token_check, "scan_max_token_id", lambda *a, **k: scanned.append(a) or real_scan(*a, **k))
    run_dir = tmp_path / "run"
    for name, (corpus, words) in cases.items():
        before, scanned[:] = listing(corpus), []
        rc, out, err = call(
            "train",
            "--config",
            TINY_YAML,
            "--no-progress",
            *TINY_RUN_OVERRIDES,
            "train.steps=2",
            f"data.path={corpus}",
            f"run_dir={run_dir}",
            capsys=capsys,
        )
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


# -- Hugging Face checkpoint directories ------------------------------------------------------------

GOLDEN_HF = ROOT / "tests" / "golden" / "hf" / "llama_gqa"  # 6 shards + index, 8 q / 2 kv heads
MISTRAL = {"model_type": "mistral", "architectures": ["MistralForCausalLM"], "sliding_window": None}

# config.json keys of the llama / mistral families: bad values of each class
_NUMBERS = [
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "intermediate_size",
    "max_position_embeddings",
    "rope_theta",
    "rms_norm_eps",
]
_WRONG_TYPE = ["abc", [64], {"a": 1}, True]
_OUT_OF_RANGE = [0, -1, 10**30, 1.5]
_NON_FINITE = [float("nan"), float("inf"), float("-inf")]
CONFIG_CASES: list[tuple[str, object]] = (
    [
        (k, v)
        for k in _NUMBERS
        for v in _WRONG_TYPE + _OUT_OF_RANGE + _NON_FINITE
        if not (k in ("rope_theta", "rms_norm_eps") and v == 1.5)
    ]  # a float is fine there
    + [("tie_word_embeddings", v) for v in ["yes", 1, [True]]]
    + [("head_dim", v) for v in [16, "8", -8, float("nan")]]
    + [("model_type", v) for v in ["gpt2", 3, None]]
    + [("architectures", v) for v in [["GPT2LMHeadModel"], "LlamaForCausalLM", 3]]
    + [("hidden_act", v) for v in ["gelu", 1]]
    + [("attention_bias", True), ("mlp_bias", True)]
    + [("attention_dropout", v) for v in [0.1, "abc", [0.0], float("nan")]]
    + [("partial_rotary_factor", v) for v in [0.5, "abc", [1.0], float("nan")]]
    + [("sliding_window", 4096)]
    + [
        ("rope_parameters", v)
        for v in [
            "default",
            [1],
            {"rope_type": "llama3", "factor": 8.0},
            {"rope_type": "default", "rope_theta": -1.0},
            {"rope_type": "default", "rope_theta": "abc"},
            {"rope_type": "default", "rope_theta": float("nan")},
        ]
    ]
    + [("rope_scaling", v) for v in [{"type": "linear", "factor": 2.0}, "dynamic", 3]]
    # consistent in itself, inconsistent with the tensors
    + [
        ("hidden_size", 128),
        ("intermediate_size", 64),
        ("vocab_size", 512),
        ("num_key_value_heads", 4),
        ("num_hidden_layers", 3),
        ("num_hidden_layers", 10**9),
    ]
    # (tie_word_embeddings=true over a checkpoint with lm_head.weight is accepted, as
    # transformers accepts it: the head is the embedding and lm_head.weight is unused)
)


def _hf_copy(tmp_path: Path, name: str, config: dict | None = None) -> Path:
    d = tmp_path / name
    shutil.copytree(GOLDEN_HF, d)
    if config is not None:
        raw = json.loads((d / "config.json").read_text())
        raw.update(config)
        (d / "config.json").write_text(json.dumps(raw))
    return d


def _shard(d: Path, i: int = 3) -> Path:
    return d / f"model-0000{i}-of-00006.safetensors"


def _damage(d: Path, how: str) -> None:
    f = _shard(d)
    blob = f.read_bytes()
    n = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + n])
    if how == "truncated":
        f.write_bytes(blob[: len(blob) // 2])
    elif how == "truncated_header":
        f.write_bytes(blob[: 8 + n // 2])
    elif how == "bad_header_json":
        f.write_bytes(blob[:8] + b"!" + blob[9:])
    elif how == "header_len_past_eof":
        f.write_bytes((len(blob) * 2).to_bytes(8, "little") + blob[8:])
    elif how in ("offsets_past_end", "offsets_overlap", "shape_vs_offsets", "bad_dtype"):
        name = max((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
        e = header[name]
        if how == "offsets_past_end":
            e["data_offsets"] = [e["data_offsets"][0], len(blob) * 4]
        elif how == "offsets_overlap":
            e["data_offsets"] = [0, e["data_offsets"][1] - e["data_offsets"][0]]
        elif how == "shape_vs_offsets":
            e["shape"] = [e["shape"][0] * 2] + e["shape"][1:]
        else:
            e["dtype"] = "Q7"
        head = json.dumps(header).encode()
        head += b" " * (-len(head) % 8)
        f.write_bytes(len(head).to_bytes(8, "little") + head + blob[8 + n :])
    elif how == "empty_file":
        f.write_bytes(b"")
    elif how == "a_directory":
        f.unlink()
        f.mkdir()
    elif how == "missing_shard":
        f.unlink()
    elif how == "index_not_json":
        (d / "model.safetensors.index.json").write_text("{not json")
    elif how == "index_without_weight_map":
        (d / "model.safetensors.index.json").write_text('{"metadata": {}}')
    elif how == "index_weight_map_a_list":
        (d / "model.safetensors.index.json").write_text('{"weight_map": [1, 2]}')
    elif how == "index_names_a_tensor_elsewhere":
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        idx["weight_map"]["model.norm.weight"] = _shard(d, 1).name  # it lives in another shard
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    elif how == "index_shard_outside_dir":
        idx = json.loads((d / "model.safetensors.index.json").read_text())
        idx["weight_map"]["model.norm.weight"] = "../elsewhere.safetensors"
        (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    elif how == "no_weights":
        for p in d.glob("model*"):
            p.unlink()
    elif how == "no_config":
        (d / "config.json").unlink()
    elif how == "config_not_json":
        (d / "config.json").write_text("{oops")
    elif how == "config_a_list":
        (d / "config.json").write_text("[1, 2]")
    elif how == "config_latin1":
        (d / "config.json").write_bytes(b'{"model_type": "llama\xe4"}')
    else:
        raise ValueError(how)


DAMAGE = [
    "truncated",
    "truncated_header",
    "bad_header_json",
    "header_len_past_eof",
    "offsets_past_end",
    "offsets_overlap",
    "shape_vs_offsets",
    "bad_dtype",
    "empty_file",
    "a_directory",
    "missing_shard",
    "index_not_json",
    "index_without_weight_map",
    "index_weight_map_a_list",
    "index_names_a_tensor_elsewhere",
    "index_shard_outside_dir",
    "no_weights",
    "no_config",
    "config_not_json",
    "config_a_list",
    "config_latin1",
]


def _refused(rc, out, err, label, out_file: Path, failures: list) -> None:
    try:
        one_line(rc, err)
        assert not out_file.exists(), f"{out_file} written"
    except AssertionError as e:
        failures.append(f"{label}: {str(e)[-300:]}")


def test_hostile_hf_config_keys_are_one_line_bad_input(tmp_path, capsys):
    """Every llama / mistral config.json key with a wrong type, an out-of-range, NaN or
    infinite value, or a value the tensors contradict: the checkpoint reader raises bad
    input (ConfigError / CheckpointError: exit 2 in every script) in one line naming
    config.json or the directory. One case of each class also through
    scripts/convert.py: one line, exit 2, nothing written."""
    from fsdp_jax.app.exits import BAD_INPUT
    from fsdp_jax.app.hf import load as hf

    failures = []
    n = 0
    for family, extra in (("llama", {}), ("mistral", MISTRAL)):
        base = _hf_copy(tmp_path, f"{family}_ok", extra)
        hf.HFCheckpoint(base)  # the family itself reads
        for key, value in CONFIG_CASES:
            raw = json.loads((base / "config.json").read_text())
            raw[key] = value
            d = tmp_path / f"{family}_case"
            d.mkdir(exist_ok=True)
            for f in base.iterdir():
                if f.name != "config.json" and not (d / f.name).exists():
                    (d / f.name).symlink_to(f)
            (d / "config.json").write_text(json.dumps(raw))
            try:
                hf.HFCheckpoint(d)
                failures.append(f"{family} {key}={value!r}: accepted")
            except BAD_INPUT as e:
                text = str(e)
                if "\n" in text.strip() or not ("config.json" in text or str(d) in text):
                    failures.append(f"{family} {key}={value!r}: {text[:200]}")
            except Exception as e:  # a traceback in every script
                failures.append(f"{family} {key}={value!r}: {type(e).__name__}: {str(e)[:200]}")
            n += 1
    assert not failures, "\n".join(failures)
    assert n == 2 * len(CONFIG_CASES) > 200
    for key, value in [
        ("hidden_size", "abc"),
        ("vocab_size", 0),
        ("rope_theta", float("nan")),
        ("rms_norm_eps", float("inf")),
        ("hidden_size", 128),
        ("model_type", "gpt2"),
        ("attention_dropout", "abc"),
    ]:
        d = _hf_copy(tmp_path, f"script_{key}_{value}", {key: value})
        o = tmp_path / f"o_{key}.safetensors"
        rc, _, err = call("convert", d, "--out", o, capsys=capsys)
        one_line(rc, err, key)
        assert not o.exists()


def test_damaged_hf_directories_are_one_line_exit_2_nothing_written(tmp_path, capsys):
    """Damaged safetensors shards, a missing shard, a broken index, no config: through
    convert.py and through the trainer (init_from=hf:DIR): one line, exit 2, no file
    and no run directory written."""
    failures = []
    bare = tmp_path / "bare.yaml"
    bare.write_text("{}\n")
    run_dir = tmp_path / "run"
    for how in DAMAGE:
        d = _hf_copy(tmp_path, how)
        _damage(d, how)
        o = tmp_path / f"o_{how}.safetensors"
        rc, out, err = call("convert", d, "--out", o, capsys=capsys)
        _refused(rc, out, err, f"convert {how}", o, failures)
        rc, out, err = call(
            "train",
            "--config",
            bare,
            "--no-progress",
            f"init_from=hf:{d}",
            "data.seq_len=32",
            "train.steps=1",
            "data.source=none",
            f"data.path={tmp_path / 'nodata'}",
            f"run_dir={run_dir}",
            capsys=capsys,
        )
        _refused(rc, out, err, f"train {how}", run_dir, failures)
    assert not failures, "\n".join(failures)


# -- tokenizer files --------------------------------------------------------------------------------


def test_hostile_tokenizer_files_are_one_line_exit_2_nothing_written(tmp_path, capsys):
    """Missing, not JSON, not UTF-8, the wrong schema, an empty vocabulary, a damaged
    SentencePiece model, a directory without one: `load_tokenizer` raises TokenizerError
    (one line), and scripts/prepare.py --tokenizer says so in one line, exit 2,
    writing no corpus."""
    from fsdp_jax.app.data.tokenizer import load_tokenizer
    from fsdp_jax.errors import TokenizerError

    good = json.loads((GOLDEN_HF / "tokenizer.json").read_text())
    cases = {
        "missing.json": None,
        "not_json.json": b"{not json",
        "latin1.json": b'{"model": "\xe4"}',
        "empty.json": b"",
        "a_list.json": b"[1, 2, 3]",
        "no_model.json": json.dumps({k: v for k, v in good.items() if k != "model"}).encode(),
        "model_not_object.json": json.dumps({**good, "model": 3}).encode(),
        "unknown_model_type.json": json.dumps({**good, "model": {**good["model"], "type": "Nope"}}).encode(),
        "vocab_a_string.json": json.dumps({**good, "model": {**good["model"], "vocab": "abc"}}).encode(),
        "empty_vocab.json": json.dumps(
            {**good, "model": {**good["model"], "vocab": {}, "merges": []}, "added_tokens": []}
        ).encode(),
        "damaged.model": b"\x00\x01 not a sentencepiece model",
        "empty_dir": "dir",
    }
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("hello world\n" * 20)
    failures = []
    for name, blob in cases.items():
        p = tmp_path / name
        if blob == "dir":
            p.mkdir()
        elif blob is not None:
            p.write_bytes(blob)
        try:
            load_tokenizer(p)
            failures.append(f"{name}: loaded")
        except TokenizerError as e:
            if "\n" in str(e).strip() or name.split(".")[0] not in str(e):
                failures.append(f"{name}: {e}")
        except Exception as e:
            failures.append(f"{name}: {type(e).__name__}: {str(e)[:200]}")
        out = tmp_path / f"corpus_{name}"
        rc, _, err = call("prepare", "--out", out, "--tokenizer", p, src, capsys=capsys)
        try:
            one_line(rc, err, name.split(".")[0])
            assert not out.exists()
        except AssertionError as e:
            failures.append(f"prepare {name}: {str(e)[-300:]}")
    assert not failures, "\n".join(failures)
