"""`model.attention: splash` on TPU targets: the trainer's step compiles deviceless for v6e
chips with JAX's Pallas splash kernel (packed rows' segment ids, a sliding-window layer
pattern) and keeps no S x S logits: its compiled temporaries are a fraction of XLA
attention's at the same shape; on a CPU run the choice is one line and exit 2."""

import json

import pytest

from fsdp_jax.targets import gpu as targets
from helpers import TINY_RUN_OVERRIDES, call, one_line, plans_in_one_child

TINY = ["--config", "configs/tiny.yaml"]
SHAPE = [  # head_dim 128 (the kernel's lane width), one kv head, packed rows of 2048
    "model.d_model=256",
    "model.n_heads=2",
    "model.n_kv_heads=1",
    "model.ffn_dim=512",
    "model.n_layers=2",
    "model.max_seq_len=2048",
    "data.seq_len=2048",
    "train.global_batch=4",
    "data.document_mask=true",
]


_WINDOWED = ("model.sliding_window=512", "model.global_every=2", "model.attn_softcap=50.0", "model.qk_norm=true")
_RING = ("mesh.context=2", "mesh.fsdp=2")
# every plan the module's slow tests read (extra overrides after SHAPE)
_CASES = [
    ("model.attention=splash",),
    ("model.attention=xla",),
    ("model.attention=splash", *_WINDOWED),
    ("model.attention=splash", *_RING),
    ("model.attention=xla", *_RING),
]


@pytest.fixture(scope="module")
def v6e_plan():
    """`v6e_plan(*extra)`: full_shard's result of `plan --config tiny.yaml --target v6e --devices 4
    --strategies full_shard --json <SHAPE> <extra>` for each of _CASES: the module's 5 plans in one
    child (libtpu, Python and JAX started once, not 5 times)."""
    assert targets.plugin_installed(kind="tpu"), "libtpu missing: python -m fsdp_jax.targets install tpu"
    args = [*TINY, "--target", "v6e", "--devices", 4, "--strategies", "full_shard", "--json", *SHAPE]
    results = plans_in_one_child(targets.make_target("v6e", devices=4), [[*args, *extra] for extra in _CASES])
    got = {}
    for extra, (rc, out, err) in zip(_CASES, results, strict=True):
        assert rc == 0, (extra, err[-3000:])
        got[extra] = json.loads(out)["strategies"]["full_shard"]
    return lambda *extra: got[extra]


@pytest.mark.slow
def test_splash_compiles_for_v6e_without_s_by_s_logits(v6e_plan):
    splash = v6e_plan("model.attention=splash")
    xla = v6e_plan("model.attention=xla")
    assert splash["platform"] == xla["platform"] == "tpu"
    # XLA attention keeps (B/dev 1) x 2 heads x 2048^2 f32 logits per layer: > 32 MiB;
    # splash's temporaries stay under a quarter of XLA's at this shape
    assert xla["compiled"]["temp"] > 32 * 2**20
    assert splash["compiled"]["temp"] < xla["compiled"]["temp"] / 4, (splash["compiled"], xla["compiled"])
    assert splash["compiled"]["peak"] < xla["compiled"]["peak"]


@pytest.mark.slow
def test_splash_with_a_sliding_window_pattern_and_softcap_compiles(v6e_plan):
    r = v6e_plan("model.attention=splash", *_WINDOWED)
    assert r["compiled"]["peak"] > 0


def test_splash_on_cpu_is_one_line_exit_2(tmp_path, capsys):
    run_dir = tmp_path / "run"
    rc, _, err = call(
        "train", *TINY, *TINY_RUN_OVERRIDES, f"run_dir={run_dir}", "model.attention=splash", capsys=capsys
    )
    one_line(rc, err, "model.attention", "splash", "TPU")
    assert not run_dir.exists()


@pytest.mark.slow
def test_splash_per_ring_block_compiles_for_v6e_with_less_than_xla_blocks(v6e_plan):
    """mesh.context=2 (fsdp 2 x context 2): the trainer's step runs splash per ring block
    (ring_flash + ring_splash) and holds less than the ring's XLA blocks (one 1024 x 2048
    query chunk's f32 scores per head and layer) at the same shape."""
    splash = v6e_plan("model.attention=splash", *_RING)
    xla = v6e_plan("model.attention=xla", *_RING)
    assert splash["platform"] == xla["platform"] == "tpu"
    assert splash["compiled"]["temp"] < xla["compiled"]["temp"] / 2, (splash["compiled"], xla["compiled"])
    assert splash["compiled"]["peak"] < xla["compiled"]["peak"]
