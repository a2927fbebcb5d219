"""`mesh.context` in the run config: bad values are one line and exit 2 with nothing
written (seq_len not divisible by 2 x context, mesh sizes that do not multiply to the
device count, an attention kernel the ring cannot run), and a good one trains."""

import json

import pytest

from helpers import TINY_RUN_OVERRIDES, call, one_line

TINY = ["--config", "configs/tiny.yaml"]
BF16 = "precision=params=float32,compute=bfloat16"  # what cuDNN computes in


def test_bad_context_inputs_one_line_exit_2_nothing_written(tmp_path, capsys):
    cases = [  # (overrides, words the one line must hold)
        (
            ["mesh.context=4", "mesh.fsdp=2", "data.seq_len=36", "model.max_seq_len=36"],
            ["data.seq_len", "2 x mesh.context = 8"],
        ),
        (["mesh.context=3"], ["mesh", "context=3", "8 devices"]),
        (["mesh.context=2", "mesh.fsdp=2"], ["mesh", "multiply to 4", "8 devices"]),
        (["mesh.context=2", "model.attention=cudnn"], ["model.attention", "cudnn"]),  # no GPU, f32 compute
        (  # cuDNN per ring block: no soft cap
            ["mesh.context=2", "model.attention=cudnn", BF16, "model.attn_softcap=30", "model.sliding_window=8"],
            ["model.attn_softcap", "soft cap"],
        ),
        (
            ["mesh.context=2", "model.attention=cudnn", BF16, "model.attn_softcap=30"],
            ["model.attn_softcap", "soft cap"],
        ),
        (  # packed documents and windows pass the ring's checks (cuDNN's packed layout, bands per
            # chunk pair); CPU has no cuDNN
            ["mesh.context=2", "model.attention=cudnn", BF16, "data.document_mask=true", "model.sliding_window=8"],
            ["model.attention", "needs a CUDA GPU"],
        ),
        (  # splash per ring block: windows pass; half blocks of whole 128-token tiles
            ["mesh.context=2", "model.attention=splash", "model.sliding_window=8"],
            ["data.seq_len", "2 x mesh.context x 128 = 512"],
        ),
        (["mesh.context=2", "model.attention=splash"], ["data.seq_len", "2 x mesh.context x 128 = 512"]),
        (["model.context_kv_pass=telepathy"], ["model.context_kv_pass", "ring"]),
        (["model.max_segments=0"], ["model.max_segments", "must be > 0"]),
        (["mesh.context=2", "mesh.rules.length=null"], ["mesh.rules.length", "context"]),
    ]
    for extra, words in cases:
        run_dir = tmp_path / "run"
        rc, _, err = call(
            "train", *TINY, *TINY_RUN_OVERRIDES, f"run_dir={run_dir}", "train.steps=1", *extra, capsys=capsys
        )
        one_line(rc, err, *words)
        assert not run_dir.exists(), extra


def test_plan_rejects_the_same_config_with_one_line(capsys):
    rc, _, err = call(
        "plan", *TINY, "--devices", "8", *TINY_RUN_OVERRIDES, "mesh.context=4", "data.seq_len=36", capsys=capsys
    )
    one_line(rc, err, "data.seq_len")


@pytest.mark.slow
def test_train_with_context_2_runs_and_logs(corpus, tmp_path, capsys):
    run_dir = tmp_path / "run"
    args = [*TINY_RUN_OVERRIDES, f"data.path={corpus}", f"run_dir={run_dir}", "train.steps=2"]
    rc, _, err = call("train", *TINY, *args, "mesh.context=2", capsys=capsys)
    assert rc == 0, err[-2000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r][-1] == 2
    assert "context: 2" in (run_dir / "config.yaml").read_text()


def test_packed_rows_of_131072_tokens_keep_segments_and_positions():
    """Long-context rows: 131072 tokens (over uint16's segment range), documents of up to
    70000 tokens; every segment id and restarting position survives, targets stay in-document."""
    import numpy as np

    from fsdp_jax.app.data.packing import batch_from_rows, pack
    from fsdp_jax.sharding.context import zigzag_order

    rng = np.random.default_rng(0)
    lengths = [70000, 40000, 15000, 6000, 1, 80000, 51000]
    examples = [(rng.integers(0, 50000, n), np.ones(n, np.uint8)) for n in lengths]
    tok, msk, seg = pack(examples, 131072)
    assert tok.shape == (2, 131072) and seg.dtype == np.uint32
    b = batch_from_rows(tok, msk, seg)
    for r in range(2):
        for s in range(1, int(seg[r].max()) + 1):
            at = np.flatnonzero(seg[r] == s)
            assert (b["positions"][r, at] == np.arange(len(at))).all()
            assert b["weights"][r, at[-1]] == 0  # the last token has no in-document target
    assert sorted(int((seg[r] == s).sum()) for r in range(2) for s in range(1, int(seg[r].max()) + 1)) == sorted(
        lengths
    )
    order = zigzag_order(131072, 8)  # the layout mesh.context=8 trains it in
    assert (
        sorted(order.tolist()) == list(range(131072))
        and order[8191] == 8191
        and order[8192] == 122880
        and order[16384] == 8192
    )


def test_a_batch_row_over_model_max_segments_is_one_data_error():
    """cuDNN's packed layout per ring block is compiled for model.max_segments segments a row;
    the trainer checks each batch (a row over it would come out NaN and be skipped)."""
    import numpy as np
    import pytest

    from fsdp_jax.app.data.batches import check_segments
    from fsdp_jax.errors import DataError

    seg = np.asarray([[1, 1, 2, 3, 3, 0], [1, 1, 1, 1, 2, 2]])  # 4 and 2 segments (padding is one)
    check_segments({"segment_ids": seg}, 4, 7, "corpus")
    check_segments(np.zeros((2, 6), np.int32), 1, 7, "corpus")  # unpacked windows: nothing to check
    with pytest.raises(DataError, match=r"step 7's batch has a row of 4 segments .* model.max_segments=3"):
        check_segments({"segment_ids": seg}, 3, 7, "corpus")
