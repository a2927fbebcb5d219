"""Optional features name the package extra that installs them when it is missing."""

import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_jax.app import extras
from fsdp_jax.app.config.parse import load_config
from fsdp_jax.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.yaml"


@pytest.fixture
def missing(monkeypatch):
    """Make `available` report the given modules as not installed."""
    gone = set()
    real = extras.available
    monkeypatch.setattr(extras, "available", lambda m: m not in gone and real(m))
    return gone


def test_every_optional_import_has_an_extra_in_pyproject():
    text = (ROOT / "pyproject.toml").read_text()
    for module, extra in extras.EXTRAS.items():
        assert f'{extra} = ["{module}' in text
    assert "chex" not in text  # declared but never used: dropped


def test_require_names_the_feature_and_the_pip_line(missing):
    missing.add("matplotlib")
    with pytest.raises(
        extras.MissingExtra,
        match=r"--plot needs the matplotlib package.*"
        r"pip install 'fsdp_jax\[plot\]'",
    ):
        extras.require("matplotlib", "--plot")
    missing.clear()
    assert extras.require("matplotlib", "--plot").__name__ == "matplotlib"


def test_tensorboard_without_tensorboardx_is_a_config_error(missing):
    assert load_config(TINY, ["train.tensorboard=true"]).train.tensorboard
    missing.add("tensorboardX")
    with pytest.raises(ConfigError) as e:
        load_config(TINY, ["train.tensorboard=true"])
    assert e.value.key == "train.tensorboard" and "fsdp_jax[tensorboard]" in str(e.value)
    load_config(TINY, ["train.tensorboard=false"])


@pytest.mark.slow
def test_plot_without_matplotlib_exits_2_with_one_line(tmp_path):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    code = (
        "import runpy, sys; sys.modules['matplotlib'] = None; sys.argv[0] = 'plot.py'; "
        "runpy.run_path('scripts/plot.py', run_name='__main__')"
    )
    r = subprocess.run([sys.executable, "-c", code, str(tmp_path)], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 2, r.stderr  # a requested feature whose package is missing: bad input
    assert r.stderr.strip().count("\n") == 0 and "fsdp_jax[plot]" in r.stderr
