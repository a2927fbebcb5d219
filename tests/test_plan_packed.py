"""The planner plans the step the trainer runs on packed data: with a packed corpus (or
data.document_mask) the batch is the dict of (B, S) arrays with segment ids, positions
and weights, and the planner's compiled figures are those of the trainer's own step on
a real packed batch."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.data.sft import prepare_examples
from fsdp_jax.app.planner.abstract_step import PACKED_BATCH, build_step, packed_batch, sample_batch
from fsdp_jax.app.planner.one_strategy import plan_strategy
from fsdp_jax.app.trainer import loop as train_lib
from fsdp_jax.hlo.memory import compiled_memory
from helpers import TINY_MODEL_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
SMALL = [*TINY_MODEL_OVERRIDES, "train.steps=10", "data.source=none"]
KEYS = ("argument", "output", "alias", "temp", "peak")


@pytest.fixture(scope="module")
def packed(tmp_path_factory):
    d = tmp_path_factory.mktemp("packed")
    rng = np.random.default_rng(0)
    with open(d / "ex.jsonl", "w") as f:
        for i in range(200):
            f.write(
                json.dumps({"prompt": "q" * int(rng.integers(1, 9)), "completion": "a" * int(rng.integers(1, 12))})
                + "\n"
            )
    prepare_examples([d / "ex.jsonl"], d / "corpus", row_len=32, val_fraction=0.1)
    return d / "corpus"


def _cfg(path, *extra):
    return load_config(ROOT / "configs" / "tiny.yaml", SMALL + [f"data.path={path}", *extra])


def test_abstract_batch_is_the_packed_dict_when_the_trainer_packs(packed, tmp_path):
    cfg = _cfg(packed, f"run_dir={tmp_path / 'run'}")
    assert packed_batch(cfg) and not packed_batch(_cfg(tmp_path / "nothing"))
    assert packed_batch(_cfg(tmp_path / "nothing", "data.document_mask=true"))
    b = build_step(cfg, "full_shard", jax.devices()[:8])
    assert sorted(b.batch) == sorted(PACKED_BATCH)
    assert {k: (v.shape, v.dtype) for k, v in b.batch.items()} == {
        k: ((16, 32), np.dtype(dt)) for k, dt in PACKED_BATCH.items()
    }
    # the trainer's own first batch has exactly these arrays, shapes and dtypes
    train, _ = train_lib.make_batches(cfg, 0, 1)
    real = next(train)
    assert {k: (v.shape, v.dtype) for k, v in real.items()} == {k: (v.shape, v.dtype) for k, v in b.batch.items()}
    fake = sample_batch(cfg, b.batch, np.random.default_rng(0))
    assert {k: (v.shape, v.dtype) for k, v in fake.items()} == {k: (v.shape, v.dtype) for k, v in real.items()}
    # the lowered step takes the segment ids and positions as arguments
    text = b.step.lower(b.state, b.batch).as_text()
    assert text.count("tensor<16x32xi32>") >= 4 and "tensor<16x32xf32>" in text


@pytest.mark.slow
def test_planner_compiles_the_trainers_packed_step(packed, tmp_path):
    cfg = _cfg(packed, f"run_dir={tmp_path / 'run'}")
    got = plan_strategy(cfg, "full_shard", jax.devices()[:8])
    run = train_lib.setup(cfg)  # the trainer's build, with a real packed batch from the corpus
    train, _ = train_lib.make_batches(cfg, 0, 1)
    compiled = run.train_step.lower(run.state, train_lib.global_batch(run.plan, next(train))).compile()
    mem = compiled_memory(compiled)
    assert {k: got["compiled"][k] for k in KEYS} == {k: mem[k] for k in KEYS}
    # the batch's five (B, S) arrays, sharded over 8 devices, in the analytic figure
    assert got["analytic"]["batch"] == 5 * 16 * 32 * 4 // 8
    # and not the token batch's figures: planning the unpacked step would differ
    tokens = plan_strategy(_cfg(tmp_path / "nothing", f"run_dir={tmp_path / 'run2'}"), "full_shard", jax.devices()[:8])
    assert tokens["analytic"]["batch"] == 16 * 33 * 4 // 8
    assert got["compiled"]["argument"] - tokens["compiled"]["argument"] == 5 * 16 * 32 * 4 // 8 - 16 * 33 * 4 // 8
