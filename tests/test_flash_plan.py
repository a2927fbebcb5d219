"""Flash attention (`model.attention=cudnn`) in the plan: the analytic model has no S x S
terms for it, and the GPU-target compile (cuDNN wheel from `python -m fsdp_jax.targets
install`) goes through and holds less than XLA's attention."""

import json
from pathlib import Path

import pytest

from fsdp_jax.app.config.parse import load_config
from fsdp_jax.app.planner.memory_model import activation_bytes
from fsdp_jax.targets import gpu as targets
from fsdp_jax.targets.plugins import cudnn_installed
from helpers import PEAK_UNDER, plans_in_one_child

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"


@pytest.mark.parametrize("remat", ["none", "dots", "dots_no_batch", "save_attn_mlp_out", "full"])
def test_flash_attention_activations_are_linear_in_the_sequence(remat):
    """Doubling seq (same tokens per device) keeps flash attention's activations; XLA's
    attention grows with S for the policies that keep or recompute the logits."""

    def act(attention, seq, batch):
        cfg = load_config(ROOT / "configs" / "llama2_7b.yaml", [f"model.attention={attention}"])
        return activation_bytes(cfg.model, remat, batch, seq, "bfloat16")["total"]

    assert act("cudnn", 8192, 1) == act("cudnn", 4096, 2)
    assert act("xla", 8192, 1) > act("xla", 4096, 2)  # the working set's logit gradient at least
    assert act("cudnn", 4096, 2) < act("xla", 4096, 2)


_SMALL = [
    "model.d_model=64",
    "model.n_layers=2",
    "model.n_heads=4",
    "model.n_kv_heads=2",
    "model.ffn_dim=128",
    "model.max_seq_len=512",
    "data.seq_len=512",
    "train.global_batch=16",
    "precision=params=float32,compute=bfloat16",
    "remat=dots",
]
_RING_SHAPE = [
    "model.d_model=256",
    "model.n_layers=2",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=512",
    "model.max_seq_len=4096",
    "data.seq_len=4096",
    "train.global_batch=2",
    "mesh.context=4",
    "mesh.fsdp=2",
    "precision=params=float32,compute=bfloat16",
    "remat=full",
]
_PACKED = ("data.document_mask=true",)
_WINDOWED = ("data.document_mask=true", "model.sliding_window=768", "model.global_every=2")
# every plan the module's slow tests read: (shape, extra overrides), each with xla and cudnn attention
_CASES = [(_SMALL, ()), (_RING_SHAPE, ()), (_RING_SHAPE, _PACKED), (_RING_SHAPE, _WINDOWED)]


@pytest.fixture(scope="module")
def h100_plans():
    """`h100_plans(shape, *extra)`: {attention: full_shard's result} of `plan --config tiny.yaml
    --target h100 --devices 8 --strategies full_shard --json <shape> <extra> model.attention=...`
    for xla and cudnn: the module's 8 plans in one child (one Python, JAX and plugin start-up, not 8)."""
    assert cudnn_installed(), (
        f"NVIDIA's cuDNN wheel is not in {targets.plugin_dir()}: run `python -m fsdp_jax.targets install`"
    )
    args = ["--config", TINY_YAML, "--target", "h100", "--devices", 8, "--strategies", "full_shard", "--json"]
    keys = [(tuple(shape), extra, a) for shape, extra in _CASES for a in ("xla", "cudnn")]
    runs = [[*args, *shape, *extra, f"model.attention={a}"] for shape, extra, a in keys]
    results = plans_in_one_child(targets.make_target("h100", devices=8), runs)
    got = {}
    for key, (rc, out, err) in zip(keys, results, strict=True):
        assert rc == 0, (key, err[-3000:])
        got[key] = json.loads(out)["strategies"]["full_shard"]
    return lambda shape, *extra: {a: got[(tuple(shape), extra, a)] for a in ("xla", "cudnn")}


@pytest.mark.slow
def test_gpu_target_compiles_cudnn_attention_with_less_memory(h100_plans):
    peaks = {a: (r["compiled"]["peak"], r["analytic"]["total"]) for a, r in h100_plans(_SMALL).items()}
    (xla_c, xla_a), (cud_c, cud_a) = peaks["xla"], peaks["cudnn"]
    # at seq 512 the S x S logits are most of XLA's attention memory: flash attention holds
    # under a fifth of it, compiled and analytic alike. (Measured: compiled 52.08 vs 6.58 MB,
    # analytic 45.51 vs 7.51 MB: the analytic model is 13% under XLA's compile and 14% over
    # cuDNN's at this size, outside the 10%; at 7B it is within 2-14%, docs/planning.md.)
    assert cud_c < xla_c / 5 and cud_a < xla_a / 5, peaks


@pytest.mark.slow
def test_gpu_target_compiles_cudnn_per_ring_block_with_less_memory(h100_plans):
    """mesh.context=4 x fsdp 2 on 8 x H100, rows of 4096 (half blocks of 512 tokens): the
    trainer's step runs cuDNN per ring block (ring_flash + ring_cudnn) and its compiled
    temporaries are smaller than the XLA ring blocks' by more than one f32 score block of a
    rank's own block (2 heads x 1024 x 1024 x 4 B = 8.4 MB), which cuDNN never materialises.
    (Measured: 29.50 vs 51.32 MB temporaries, peaks 31.50 vs 53.31 MB.) The analytic model of
    the XLA ring (planner/context_memory.py: the score block at 8 + 2c bytes a score) is never
    under that peak by more than helpers.PEAK_UNDER (5%): 52.34 MB, 1.8% under on jax 0.10.2
    (48.15 MB, 9.7% under, at 8 + c before); jax 0.12.0.1's XLA:GPU compiles the same step to
    42.28 MB, where the model is 24% over (docs/planning.md)."""
    plans = h100_plans(_RING_SHAPE)
    got = {k: r["compiled"] for k, r in plans.items()}
    assert got["xla"]["temp"] - got["cudnn"]["temp"] > 2 * 1024 * 1024 * 4, got
    assert got["cudnn"]["peak"] < got["xla"]["peak"], got
    analytic = plans["xla"]["analytic"]["total"]
    assert analytic >= (1 - PEAK_UNDER) * got["xla"]["peak"], (got["xla"]["peak"], analytic)


@pytest.mark.slow
def test_gpu_target_compiles_packed_cudnn_per_ring_block_with_less_memory(h100_plans):
    """The same step with data.document_mask=true (segment ids per row): cuDNN per ring block
    in its packed layout (ring_cudnn.packed_kernel) compiles for H100 and keeps its lead of
    more than one f32 score block over the XLA ring blocks with the same segment ids."""
    got = {k: r["compiled"] for k, r in h100_plans(_RING_SHAPE, *_PACKED).items()}
    assert got["xla"]["temp"] - got["cudnn"]["temp"] > 2 * 1024 * 1024 * 4, got
    assert got["cudnn"]["peak"] < got["xla"]["peak"], got


@pytest.mark.slow
def test_gpu_target_compiles_windowed_cudnn_per_ring_block_with_less_memory(h100_plans):
    """The same step with packed documents and Gemma's pattern (a sliding window of 768, across
    a 512-token chunk, on every layer but each second): the decoder's cuDNN ring runs the
    windowed chunk pairs (ring_window, lax.switch per pair on the rank and the layer's flag) and
    keeps its lead of more than one f32 score block over the XLA ring blocks with that window."""
    plans = h100_plans(_RING_SHAPE, *_WINDOWED)
    got = {k: r["compiled"] for k, r in plans.items()}
    assert got["xla"]["temp"] - got["cudnn"]["temp"] > 2 * 1024 * 1024 * 4, got
    assert got["cudnn"]["peak"] < got["xla"]["peak"], got
