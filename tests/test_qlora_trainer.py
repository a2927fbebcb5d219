"""QLoRA through the trainer: a float Hugging Face base (init_from=hf:) quantised as it
loads, a PEFT adapter (lora.init_from=peft:) on top; the run trains, its checkpoint refuses
a resume under another scheme in one line, `export --peft` writes the trained adapters and
`export --hf` writes the dequantised base merged with them (and says so)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest

from fsdp_jax.app.hf import peft
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.trainer.loop import train
from fsdp_jax.app.trainer.setup import load_run_config, setup
from fsdp_jax.errors import CheckpointError
from helpers import TINY_RUN_OVERRIDES, call

pytestmark = pytest.mark.slow  # end-to-end training runs

ROOT = Path(__file__).resolve().parents[1]
GOLDEN = ROOT / "tests" / "golden"
RUN = [o for o in TINY_RUN_OVERRIDES if not o.startswith("model.")] + ["train.steps=4", "train.checkpoint_every=4"]
QLORA = ["lora.rank=4", "lora.alpha=8", "lora.base_quant=nf4", "lora.quant_block=8", "lora.double_quant=true"]


def config(corpus, run_dir, *extra):
    over = RUN + QLORA + [f"data.path={corpus}", f"run_dir={run_dir}", f"init_from=hf:{GOLDEN / 'hf' / 'llama3'}"]
    over += [f"lora.init_from=peft:{GOLDEN / 'peft' / 'llama3'}", *extra]
    return load_run_config(ROOT / "configs" / "hf_tiny_finetune.yaml", over)


@pytest.fixture(scope="module")
def run(corpus, tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("qlora") / "run"
    summary = train(config(corpus, run_dir), progress=False)
    return {"dir": run_dir, "state": jax.device_get(summary["run"].state)}


def test_trains_on_the_quantised_base(run):
    losses = [json.loads(x)["loss"] for x in (run["dir"] / "metrics.jsonl").read_text().splitlines() if '"loss"' in x]
    assert len(losses) == 4 and all(np.isfinite(losses))
    base, _ = lora_lib.split(run["state"].params)
    wq = base["blocks"]["attn"]["wq"]
    assert set(wq) == {"codes", "absmax_codes", "absmax2", "offset"} and wq["codes"].dtype == np.uint8


def test_resume_under_another_scheme_is_refused_in_one_line(corpus, run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(run["dir"], run_dir)
    with pytest.raises(CheckpointError) as e:
        setup(config(corpus, run_dir, "lora.double_quant=false"))
    msg = str(e.value)
    assert "\n" not in msg and "nf4/8/dq" in msg and "nf4/8" in msg, msg


def test_export_peft_and_merged(run, tmp_path, capsys):
    rc, out, err = call("export", str(run["dir"]), "--peft", str(tmp_path / "adapter"), capsys=capsys)
    assert rc == 0, err
    from fsdp_jax.app.hf import load as hf

    base_cfg = hf.HFCheckpoint(GOLDEN / "hf" / "llama3").config
    adapters = peft.read_peft(tmp_path / "adapter", base_cfg, lora_lib.LoraSpec(4, 8.0))
    _, trained = lora_lib.split(run["state"].params)
    for a, b in zip(jax.tree.leaves(adapters), jax.tree.leaves(trained)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    rc, out, err = call("export", str(run["dir"]), "--hf", str(tmp_path / "merged"), capsys=capsys)
    assert rc == 0, err
    assert "dequantised weights" in out, out
    # the merged model reproduces the run's logits (adapters over the dequantised base)
    from fsdp_jax.app.models.decoder import Decoder
    from fsdp_jax.app.trainer.build import trainer_model
    from fsdp_jax.model.fns import from_nnx

    cfg = config(GOLDEN, tmp_path / "unused")
    from fsdp_jax.app.trainer.build import lora_spec

    tokens = np.arange(24, dtype=np.int32).reshape(2, 12) % 256
    want = np.asarray(jax.jit(trainer_model(cfg.model, "none", lora_spec(cfg)).apply)(run["state"].params, tokens))
    merged = hf.HFCheckpoint(tmp_path / "merged")
    plain = from_nnx(lambda r: Decoder(merged.config, rngs=r))
    abstract = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), plain.abstract_params)
    got = np.asarray(jax.jit(plain.apply)(hf.load_params(merged, abstract), tokens))
    assert float(np.abs(got - want).max()) < 1e-4
