"""verify on the batches the trainer runs: `fsdp-jax verify` on a packed corpus compares the
masked, per-segment packed step (fsdp_jax.app.verify_batches), and `fsdp_jax.verify` with
batches that differ in shape or structure is one line, not a raw TypeError."""

import json

import jax
import numpy as np
import pytest
from test_verify import SGD, classification_batches, linen_setup

import fsdp_jax as fj
from fsdp_jax.errors import VerifyError
from helpers import TINY_MODEL_OVERRIDES, call


@pytest.mark.parametrize(
    "change, match",
    [
        (lambda b: {"x": b["x"][:, :16], "y": b["y"]}, r"batches\[1\] leaf x is float32\[16, 16\], batches\[0\]'s is"),
        (lambda b: {"x": b["x"].astype(np.float16), "y": b["y"]}, r"batches\[1\] leaf x is float16\[16, 32\]"),
        (lambda b: {"x": b["x"]}, r"batches\[1\] is not structured like batches\[0\]"),
    ],
)
def test_batches_of_different_shapes_are_one_line(change, match):
    model, loss_fn = linen_setup()
    b = classification_batches(3)
    b[1] = change(b[1])
    with pytest.raises(VerifyError, match=f"^verify: {match}") as e:
        fj.verify(model, SGD, loss_fn, batches=b, strategies=["full_shard"], devices=8, steps=3)
    assert "\n" not in str(e.value)


@pytest.fixture(scope="module")
def packed_corpus(tmp_path_factory):
    from fsdp_jax.app.data.sft import prepare_examples

    d = tmp_path_factory.mktemp("packed")
    src = d / "ex.jsonl"
    rng = np.random.default_rng(0)
    with open(src, "w") as f:
        for i in range(240):
            f.write(
                json.dumps({"prompt": f"Q{i}: " + "ab" * int(rng.integers(1, 6)), "completion": f" A{i % 7}"}) + "\n"
            )
    prepare_examples([src], d / "sft", row_len=32, val_fraction=0.1)
    return d / "sft"


@pytest.mark.slow
def test_cli_verifies_the_packed_step_the_trainer_runs(packed_corpus, capsys):
    from fsdp_jax.app.config import load_config
    from fsdp_jax.app.data.batches import make_batches
    from fsdp_jax.app.trainer.build import make_loss_fn, trainer_model

    overrides = [*TINY_MODEL_OVERRIDES, f"data.path={packed_corpus}", "train.eval_every=0"]
    rc, out, err = call(
        "verify",
        "--config",
        "configs/tiny.yaml",
        "--strategies",
        "full_shard",
        "--steps",
        "2",
        "--json",
        *overrides,
        capsys=capsys,
    )
    assert rc == 0, err
    doc = json.loads(out)
    (note,) = [n for n in doc["notes"] if n.startswith("batches:")]
    assert note.startswith(f"batches: the trainer's first 2 packed rows of {packed_corpus} (16, 32)")
    # the reference loss is the trainer's token-mean loss on the trainer's first packed batch
    cfg = load_config("configs/tiny.yaml", overrides)
    model = trainer_model(cfg.model, cfg.remat)
    first = {k: np.asarray(v) for k, v in next(make_batches(cfg, 0, 1)[0]).items()}
    assert first["weights"].sum() < first["weights"].size  # prompts and padding are not trained
    loss = make_loss_fn(model)(model.init(jax.random.key(0)), first)
    assert doc["reference_loss"][0] == pytest.approx(float(loss.total / loss.count), rel=1e-5)
    assert doc["passed"] is True


def test_cli_with_a_corpus_beyond_the_model_vocab_is_one_line(packed_corpus, capsys):
    overrides = [*TINY_MODEL_OVERRIDES, f"data.path={packed_corpus}", "model.vocab_size=64"]
    rc, out, err = call("verify", "--config", "configs/tiny.yaml", "--strategies", "ddp", *overrides, capsys=capsys)
    assert rc == 2 and len(err.strip().splitlines()) == 1, err
    assert "outside model.vocab_size=64" in err and out == ""
