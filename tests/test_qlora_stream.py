"""Quantise-on-load streamed layer by layer (`fsdp_jax.app.trainer.qlora_load`): from a float
Hugging Face checkpoint, the stacked weights read one layer at a time give the same leaves,
bit for bit and on the same shardings, as loading the float base whole and quantising it."""

from __future__ import annotations

from pathlib import Path

import jax
import numpy as np
import pytest

from fsdp_jax.app.hf.load import load_params, open_init
from fsdp_jax.app.models import lora as lora_lib
from fsdp_jax.app.planner.abstract_step import build_step
from fsdp_jax.app.trainer.build import lora_spec
from fsdp_jax.app.trainer.qlora_load import load_quantised
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.checkpoint import tree_paths
from helpers import TINY_RUN_OVERRIDES

ROOT = Path(__file__).resolve().parents[1]
HF = ROOT / "tests" / "golden" / "hf" / "llama3"
RUN = [o for o in TINY_RUN_OVERRIDES if not o.startswith("model.")] + [f"init_from=hf:{HF}", "lora.rank=4"]


NF4_DQ = ["lora.base_quant=nf4", "lora.quant_block=8", "lora.double_quant=true"]


@pytest.mark.parametrize(
    "quant, scan",
    [(NF4_DQ, True), (["lora.base_quant=int8"], True), (NF4_DQ, False)],
    ids=["nf4-dq", "int8", "nf4-dq-unscanned"],
)
@pytest.mark.fast_cases("int8")
def test_streamed_load_equals_the_whole_load(quant, scan):
    """Scanned: each stacked weight layer by layer; unscanned (`model.scan_layers=false`): each
    layer's weight read alone, quantised and dropped before the next."""
    cfg = load_run_config(ROOT / "configs" / "hf_tiny_finetune.yaml", RUN + quant + [f"model.scan_layers={scan}"])
    spec = lora_spec(cfg).base_quant
    abstract = lora_lib.split(build_step(cfg, "full_shard").state.params)[0]
    ckpt = open_init(cfg.init_from, cfg.model)
    depth = 1 if scan else 0
    whole = load_quantised(lambda a: load_params(ckpt, a), abstract, spec, depth)
    whole_load = lambda a: pytest.fail("the float base was loaded whole")  # noqa: E731
    streamed = load_quantised(whole_load, abstract, spec, depth, ckpt)
    want, got = tree_paths(whole), tree_paths(streamed)
    assert want.keys() == got.keys() and any(p.endswith("w_down/codes") for p in got)
    for p, x in want.items():
        assert got[p].sharding == x.sharding and got[p].dtype == x.dtype, p
        np.testing.assert_array_equal(np.asarray(jax.device_get(got[p])), np.asarray(jax.device_get(x)), err_msg=p)
