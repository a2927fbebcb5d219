"""A refusal is the only line on stderr: warnings raised while a command checks its input and
builds its plan are held (`fsdp_jax.app.held_warnings`), printed once it has started or
returned, dropped when it fails."""

from __future__ import annotations

import argparse
import sys
import warnings

import pytest

from fsdp_jax.app import held_warnings
from fsdp_jax.app.cli.command import run_command
from fsdp_jax.errors import ConfigError, ReplicatedWarning, UsageError
from helpers import TINY_RUN_OVERRIDES, call, one_line


def _stderr(message, category, filename, lineno, file=None, line=None):
    sys.stderr.write(warnings.formatwarning(message, category, filename, lineno, line))


@pytest.fixture(autouse=True)
def printed_warnings(monkeypatch):
    """Warnings printed to stderr as outside pytest (which records them instead), every time."""
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        monkeypatch.setattr(warnings, "showwarning", _stderr)
        yield


def _run(capsys, *steps):
    """(exit code, stdout, stderr) of `run_command` over a body doing `steps` in order."""

    def body(_args):
        for step in steps:
            step()
        return 0

    capsys.readouterr()
    rc = run_command(argparse.ArgumentParser(), body, [])
    out, err = capsys.readouterr()
    return rc, out, err


def _warn():
    warnings.warn("12.5% of parameter bytes are replicated", ReplicatedWarning, stacklevel=1)


def _raise(e):
    def step():
        raise e

    return step


@pytest.mark.parametrize(
    "error, code, word",
    [
        (ConfigError("lora.base_quant", "'nf5' is not nf4 | int8 | none"), 2, "lora.base_quant"),
        (UsageError("--peft and --hf do not go together"), 2, "--peft"),
        (OSError("No space left on device"), 1, "No space"),
        (RuntimeError("a bug"), 1, "a bug"),
    ],
)
def test_a_refusal_after_a_warning_is_the_only_line(capsys, error, code, word):
    rc, _, err = _run(capsys, _warn, _raise(error))
    one_line(rc, err, word, code=code)


def test_warnings_of_a_command_that_returns_are_printed(capsys):
    rc, out, err = _run(capsys, _warn, lambda: print("plan"))
    assert rc == 0 and out == "plan\n" and "ReplicatedWarning: 12.5%" in err


def test_after_release_warnings_print_as_they_come(capsys):
    """The trainer releases them once set up: a failure after that is no refusal of the input."""
    rc, _, err = _run(
        capsys, _warn, held_warnings.release, lambda: print("step 1", file=sys.stderr), _warn, _raise(OSError("disk"))
    )
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith(" ")]
    assert rc == 1 and "ReplicatedWarning" in lines[0], err
    assert lines[1] == "step 1" and "ReplicatedWarning" in lines[2] and lines[3] == "error: disk", err
    held_warnings.release()  # outside `held()`: nothing to do
    assert warnings.showwarning is _stderr


def test_train_lora_with_nvme_refusal_is_one_line(corpus, tmp_path, capsys):
    """The trainer's own case: the sharding check warns (a LoRA adapter replicated) while the
    plan is built, then the nvme step refuses frozen params; only the refusal is printed."""
    d = tmp_path / "nvme"
    d.mkdir()
    args = [
        *TINY_RUN_OVERRIDES,
        f"data.path={corpus}",
        f"run_dir={tmp_path / 'run'}",
        f"offload_dirs={d}",
        "mesh.min_shard_size=1000000000",
    ]
    rc, _, err = call(
        "train", "--config", "configs/tiny.yaml", *args, "offload=optimizer:nvme", "lora.rank=4", capsys=capsys
    )
    one_line(rc, err, "frozen params")


def test_a_filter_the_command_installs_outlives_the_block(capsys):
    """The checkpointer silences the save coroutines a failed save leaves behind (they warn
    at interpreter exit, after the error line); the hold must not undo that filter on the way
    out (with `warnings.catch_warnings` it did: test_faults' read-only checkpoint run printed
    three RuntimeWarnings after its one line)."""
    message = "coroutine held-warnings-test was never awaited"
    with warnings.catch_warnings():  # this test's own filters back afterwards
        with pytest.raises(OSError), held_warnings.held():
            warnings.filterwarnings("ignore", message="coroutine .* was never awaited", category=RuntimeWarning)
            raise OSError("disk")
        warnings.warn(message, RuntimeWarning)
    assert message not in capsys.readouterr().err
