"""cuDNN attention computes in bfloat16 / float16 only: a config asking for it with float32
compute is one line naming model.attention and precision, exit 2, in every command (it was a
traceback from the planner's compiling child, exit 1)."""

import pytest

from fsdp_jax.app.config import load_config, validate
from fsdp_jax.errors import ConfigError
from helpers import call

TINY = "configs/tiny.yaml"  # precision params=float32,compute=float32


@pytest.mark.parametrize(
    "command, args",
    [
        ("plan", ["--target", "h100", "--devices", "8"]),
        ("plan", ["--devices", "8"]),
        ("train", []),
        ("verify", ["--strategies", "ddp"]),
    ],
)
def test_cudnn_attention_with_float32_compute_is_one_line_exit_2(command, args, capsys, tmp_path):
    rc, out, err = call(
        command, "--config", TINY, *args, "model.attention=cudnn", f"run_dir={tmp_path}/r", capsys=capsys
    )
    assert rc == 2, (out, err)
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert "model.attention" in err and "float32" in err and "compute=bfloat16" in err
    assert not (tmp_path / "r").exists()


@pytest.mark.parametrize("compute", ["bfloat16", "float16"])
def test_cudnn_attention_with_half_precision_compute_validates(compute):
    validate(load_config(TINY, ["model.attention=cudnn", f"precision=params=float32,compute={compute}"]))


def test_the_error_names_the_compute_dtype():
    with pytest.raises(ConfigError, match=r"model\.attention.*no float32 kernel"):
        validate(load_config(TINY, ["model.attention=cudnn"]))
