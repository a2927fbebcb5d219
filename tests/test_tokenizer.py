"""Real tokenizers (fsdp_jax.app.data.tokenizer) in corpora and samples, and the CPU
walk-through of the Llama fine-tune (import, tokenize, train, export)."""

import json
import re
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from fsdp_jax.app.data import corpus as data
from fsdp_jax.app.data.tokenizer import load_tokenizer, read_documents

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden" / "hf"
STDLIB = Path(sysconfig.get_paths()["stdlib"])
FILES = ("textwrap.py", "string.py", "bisect.py", "heapq.py", "keyword.py", "colorsys.py")


def script(name):
    """The command module behind scripts/<name>.py (the script is a shim over its main)."""
    from fsdp_jax.app.cli.entry import SCRIPTS, command_module

    return command_module(SCRIPTS[name])


def train_bpe(out: Path, vocab: int, eos: bool = True) -> Path:
    """A byte-level BPE trained with `tokenizers` on a few stdlib files."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    specials = ["<|endoftext|>"] if eos else []
    tok.train(
        [str(STDLIB / f) for f in FILES[:4]],
        trainers.BpeTrainer(
            vocab_size=vocab,
            special_tokens=specials,
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    return out / "tokenizer.json"


def train_sentencepiece(out: Path, vocab: int = 600) -> Path:
    import sentencepiece as spm

    out.mkdir(parents=True, exist_ok=True)
    spm.SentencePieceTrainer.train(
        input=",".join(str(STDLIB / f) for f in FILES[:4]),
        model_prefix=str(out / "sp"),
        vocab_size=vocab,
        model_type="bpe",
        character_coverage=0.995,
        minloglevel=2,
        byte_fallback=True,
    )
    return out / "sp.model"


def sources(tmp: Path) -> Path:
    """Several text files and one .jsonl of three documents."""
    src = tmp / "src"
    src.mkdir()
    for f in FILES:
        (src / f).write_bytes((STDLIB / f).read_bytes())
    docs = [{"text": "héllo wörld\n"}, {"text": "def f(x):\n    return x\n"}, {"text": "ünïcode ✓"}]
    (src / "d.jsonl").write_text("\n".join(json.dumps(d) for d in docs) + "\n")
    return src


def split_docs(tokens: np.ndarray, eos: int) -> list[list[int]]:
    ends = np.flatnonzero(tokens == eos)
    assert len(ends) and ends[-1] == len(tokens) - 1  # every document ends with EOS
    return [t.tolist() for t in np.split(tokens, ends + 1)[:-1]]


def check_corpus(out: Path, src: Path, tok_path, meta: dict):
    tok = load_tokenizer(tok_path)
    assert meta["vocab_size"] == tok.vocab_size and meta["eos_id"] == tok.eos_id
    assert meta["tokenizer"] == tok.path and meta["dtype"] == data.token_dtype(tok.vocab_size).name
    assert data.load_meta(out) == meta  # the trainer's reader accepts it
    got = []
    for split in ("train", "val"):
        tokens = np.fromfile(out / f"{split}.bin", meta["dtype"])
        got += [d[:-1] for d in split_docs(tokens, tok.eos_id)]
    docs = [d for f in sorted(src.iterdir()) for d in read_documents(f)]
    want = [tok.encode(d) for d in docs]
    assert sorted(got) == sorted(want) and len(got) == meta["documents"] == len(FILES) + 3
    # the held-out split is the byte corpus' split: the same whole files
    ref = data.prepare_text([src], out.parent / "bytes", val_fraction=0.2, seed=3)
    assert (meta["train_files"], meta["val_files"]) == (ref["train_files"], ref["val_files"])


def test_hf_bpe_corpus_is_encode_plus_eos_per_document(tmp_path):
    tj = train_bpe(tmp_path / "tok", 300)
    src = sources(tmp_path)
    meta = data.prepare_text([src], tmp_path / "out", val_fraction=0.2, seed=3, tokenizer=str(tj))
    assert meta["tokenizer_kind"] == "hf" and meta["dtype"] == "uint16" and meta["split"] == "files"
    check_corpus(tmp_path / "out", src, tj, meta)
    tok = load_tokenizer(tj)
    text = (STDLIB / "textwrap.py").read_text()
    assert tok.decode(tok.encode(text)) == text  # byte-level: decodes exactly


def test_sentencepiece_corpus_is_encode_plus_eos_per_document(tmp_path):
    sp = train_sentencepiece(tmp_path / "sp")
    src = sources(tmp_path)
    meta = data.prepare_text([src], tmp_path / "out", val_fraction=0.2, seed=3, tokenizer=str(sp), threads=2)
    assert meta["tokenizer_kind"] == "sentencepiece" and meta["vocab_size"] == 600
    check_corpus(tmp_path / "out", src, sp, meta)


def test_single_file_splits_by_tokens(tmp_path):
    tj = GOLDEN / "llama_gqa"  # a model directory: its tokenizer.json and tokenizer_config.json
    meta = data.prepare_text([STDLIB / "textwrap.py"], tmp_path / "out", val_fraction=0.1, tokenizer=str(tj))
    tok = load_tokenizer(tj)
    assert tok.eos_id == 2 and tok.vocab_size == 256  # </s> named by tokenizer_config.json
    assert meta["split"] == "tokens" and meta["val_tokens"] == round(0.1 * (meta["train_tokens"] + meta["val_tokens"]))
    both = np.concatenate([np.fromfile(tmp_path / "out" / f"{s}.bin", np.uint16) for s in ("train", "val")])
    assert both.tolist() == tok.encode((STDLIB / "textwrap.py").read_text()) + [2]


def test_bad_tokenizers_exit_2_and_write_nothing(tmp_path, capsys):
    prep = script("prepare")
    src = sources(tmp_path)
    noeos = train_bpe(tmp_path / "noeos", 280, eos=False)
    big = train_bpe(tmp_path / "big", 300)
    (tmp_path / "junk.json").write_text("{not json")
    (tmp_path / "junk.model").write_bytes(b"\x00garbage")
    (tmp_path / "empty").mkdir()
    cases = [
        ([str(tmp_path / "missing.json")], "not found"),
        ([str(tmp_path / "empty")], "no tokenizer.json"),
        ([str(tmp_path / "junk.json")], "cannot load"),
        ([str(tmp_path / "junk.model")], "cannot load"),
        ([str(noeos)], "--eos"),
        ([str(big), "--eos", "<nope>"], "<nope>"),
        ([str(big), "--model", str(GOLDEN / "llama_gqa")], "vocab size 300 exceeds"),
    ]
    for i, (args, word) in enumerate(cases):
        out = tmp_path / f"out{i}"
        rc = prep.main(["--out", str(out), str(src), "--no-progress", "--tokenizer", *args])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and word in err, (args, err)
        assert not out.exists(), args
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"txt": 1}\n')
    rc = prep.main(["--out", str(tmp_path / "o"), str(bad), "--tokenizer", str(big)])
    assert rc == 2 and "bad.jsonl:1" in capsys.readouterr().err and not (tmp_path / "o" / "meta.json").exists()


def test_tokenizer_vocab_larger_than_model_is_refused_by_trainer(tmp_path):
    from fsdp_jax.app.trainer.setup import load_run_config, setup
    from fsdp_jax.errors import ConfigError

    big = train_bpe(tmp_path / "big", 300)
    data.prepare_text([sources(tmp_path)], tmp_path / "d", val_fraction=0.2, tokenizer=str(big))
    yml = tmp_path / "c.yaml"
    yml.write_text(
        f"init_from: hf:{GOLDEN / 'llama_gqa'}\nrun_dir: {tmp_path / 'run'}\n"
        f"data: {{seq_len: 32, path: {tmp_path / 'd'}, source: none}}\n"
    )
    with pytest.raises(ConfigError, match=r"model\.vocab_size.*256.*vocab_size 300.*tokenizer .*big"):
        setup(load_run_config(yml))
    assert not (tmp_path / "run").exists()


@pytest.mark.slow
def test_walkthrough_import_tokenize_train_sample_export(tmp_path, capsys):
    """README "Fine-tune a Llama checkpoint": configs/hf_tiny_finetune.yaml end to end."""
    from fsdp_jax.app.hf.load import HFCheckpoint, load_params
    from fsdp_jax.app.trainer.loop import train
    from fsdp_jax.app.trainer.setup import load_run_config
    from fsdp_jax.checkpoint import Checkpointer

    d, run, out = tmp_path / "data", tmp_path / "run", tmp_path / "hf_out"
    assert (
        script("prepare").main(
            [
                "--out",
                str(d),
                "--stdlib",
                "--no-progress",
                "--tokenizer",
                str(GOLDEN / "llama_gqa"),
                "--model",
                str(GOLDEN / "llama_gqa"),
            ]
        )
        == 0
    )
    cfg = load_run_config(
        ROOT / "configs" / "hf_tiny_finetune.yaml",
        [
            f"data.path={d}",
            f"run_dir={run}",
            "train.steps=12",
            "train.log_every=4",
            "train.eval_every=12",
            "train.checkpoint_every=12",
            "train.sample_tokens=24",
            f"init_from=hf:{GOLDEN / 'llama_gqa'}",
        ],
    )
    s = train(cfg, progress=False)
    losses = [
        json.loads(x)["loss"] for x in (run / "metrics.jsonl").read_text().splitlines() if "loss" in json.loads(x)
    ]
    assert losses[-1] < losses[0]  # it trains from the imported weights
    prompt, _, cont = s["sample"].partition("\u2016")
    tok = load_tokenizer(GOLDEN / "llama_gqa")
    assert cont.strip() and not re.fullmatch(r"[\d ]+", cont)  # decoded text, not token ids
    assert prompt == tok.decode(tok.encode(prompt))  # the prompt is decoded validation text
    saved = (run / "config.yaml").read_text()
    assert "n_kv_heads: 2" in saved and "tie_word_embeddings: false" in saved  # complete config
    assert script("export").main([str(run), "--hf", str(out), "--max-shard-size", "100KB"]) == 0
    assert (out / "tokenizer.json").is_file() and (out / "model.safetensors.index.json").is_file()
    ck = Checkpointer(run / "checkpoints", read_only=True)
    back = load_params(HFCheckpoint(out), s["run"].state.params)  # same shapes and shardings
    for path, leaf in [("embed", back["embed"]), ("blocks/attn/wq", back["blocks"]["attn"]["wq"])]:
        assert np.array_equal(np.asarray(leaf), ck.read_leaf(12, f"params/{path}"))


def test_large_vocab_is_stored_as_uint32(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(70_000)} | {"[UNK]": 70_000, "</s>": 70_001}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(tmp_path / "tokenizer.json"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.txt").write_text("w69999 w1 w65536 nope " * 50)
    (src / "b.txt").write_text("w70 w65535")
    meta = data.prepare_text([src], tmp_path / "out", val_fraction=0.1, tokenizer=str(tmp_path))
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 70_002 and meta["eos_id"] == 70_001
    train = np.fromfile(tmp_path / "out" / "train.bin", np.uint32).tolist()
    val = np.fromfile(tmp_path / "out" / "val.bin", np.uint32).tolist()
    assert sorted([train, val]) == sorted([[69999, 1, 65536, 70_000] * 50 + [70_001], [70, 65535, 70_001]])
