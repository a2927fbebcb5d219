"""Damaged checkpoints by class, through every script that reads one (issue #28: CRC
checks on the restore and export paths). Each damage class (a flipped bit that keeps the
size, a truncated file, a missing file, a manifest that is not JSON, a manifest without
its file list) is applied to the newest step, to a step asked for by --step, or to every
step, and read by `export.py --out`, `export.py --hf`, `train.py` resuming the run and
`train.py init_from=<checkpoints>`. The contract: a damaged newest step is skipped with a
warning naming the damage; a damaged step asked for, or every step damaged, is one line
naming the step and the file, exit 2, nothing written and nothing moved."""

import json
import os
import shutil
from pathlib import Path

import pytest

from fsdp_jax import checkpoint as ck
from helpers import TINY_RUN_OVERRIDES, call, one_line, script

ROOT = Path(__file__).resolve().parents[1]
TINY_YAML = ROOT / "configs" / "tiny.yaml"


@pytest.fixture(scope="module")
def trained(corpus, tmp_path_factory):
    """A tiny run with committed steps 2 and 4."""
    run = tmp_path_factory.mktemp("damage") / "run"
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = script("train").main(
            [
                "--config",
                str(TINY_YAML),
                "--no-progress",
                *TINY_RUN_OVERRIDES,
                f"data.path={corpus}",
                f"run_dir={run}",
                "train.steps=4",
                "train.checkpoint_every=2",
                "train.keep_checkpoints=5",
            ]
        )
    finally:
        os.chdir(cwd)
    assert rc == 0
    assert ck.Checkpointer(run / "checkpoints", read_only=True).steps() == [2, 4]
    return run


def _biggest(step_dir: Path) -> Path:
    return max((f for f in (step_dir / "state").rglob("*") if f.is_file()), key=lambda f: f.stat().st_size)


def _flip(d: Path) -> str:
    f = _biggest(d)
    blob = bytearray(f.read_bytes())
    blob[len(blob) // 2] ^= 0x08
    f.write_bytes(bytes(blob))
    return str(f.relative_to(d))


def _truncate(d: Path) -> str:
    f = _biggest(d)
    os.truncate(f, f.stat().st_size // 2)
    return str(f.relative_to(d))


def _remove(d: Path) -> str:
    f = _biggest(d)
    f.unlink()
    return str(f.relative_to(d))


def _manifest_garbage(d: Path) -> str:
    (d / ck.MANIFEST).write_text('{"step": 4, "files": {')
    return "manifest"


def _manifest_without_files(d: Path) -> str:
    m = json.loads((d / ck.MANIFEST).read_text())
    del m["files"]
    (d / ck.MANIFEST).write_text(json.dumps(m))
    return "manifest"


# damage -> (apply(step_dir) -> the word the line must name, the words saying what is wrong)
DAMAGE = {
    "flipped_bit": (_flip, "changed since it was saved"),
    "truncated": (_truncate, "bytes"),
    "missing_file": (_remove, "is missing"),
    "manifest_not_json": (_manifest_garbage, "unreadable"),
    "manifest_without_files": (_manifest_without_files, "unreadable"),
}


def _listing(d: Path) -> dict[str, int]:
    return {str(p.relative_to(d)): p.stat().st_size for p in sorted(d.rglob("*")) if p.is_file()}


def _damaged_copy(trained: Path, tmp_path: Path, damage: str, steps: list[int]) -> tuple[Path, list[str]]:
    run = tmp_path / "run"
    shutil.copytree(trained, run)
    apply, _ = DAMAGE[damage]
    return run, [apply(run / "checkpoints" / str(s)) for s in steps]


EXPORTS = {"out": lambda tmp: ["--out", str(tmp / "m.safetensors")], "hf": lambda tmp: ["--hf", str(tmp / "hf")]}


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("dest", EXPORTS)
@pytest.mark.fast_cases("out-truncated")
def test_export_refuses_a_damaged_step_asked_for_and_skips_a_damaged_newest(damage, dest, trained, tmp_path, capsys):
    """Mutation: export --hf not checking the manifest of a step given by --step (as before
    issue #28) -> a flipped bit is exported silently; not checking the newest -> the same."""
    run, files = _damaged_copy(trained, tmp_path, damage, [4])
    before = _listing(run)
    what = DAMAGE[damage][1]
    # asked for by --step: refused in one line naming the step and the file
    rc, out, err = call("export", run, *EXPORTS[dest](tmp_path), "--step", "4", capsys=capsys)
    line = one_line(rc, err, "step 4", files[0], what)
    assert not (tmp_path / "m.safetensors").exists() and not (tmp_path / "hf").exists(), line
    assert [p.name for p in tmp_path.iterdir()] == ["run"], line  # no temporary left behind
    # newest damaged: a warning naming it, step 2 exported
    rc, out, err = call("export", run, *EXPORTS[dest](tmp_path), capsys=capsys)
    assert rc == 0 and err == "", err
    assert "exported step 2" in out and "step 4" in out and files[0] in out and what in out, out
    assert _listing(run) == before  # the damaged step is left where it is


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("dest", EXPORTS)
def test_export_of_a_run_whose_every_step_is_damaged_is_one_line(damage, dest, trained, tmp_path, capsys):
    run, files = _damaged_copy(trained, tmp_path, damage, [2, 4])
    rc, _, err = call("export", run, *EXPORTS[dest](tmp_path), capsys=capsys)
    line = one_line(rc, err, "step 4", "step 2", files[0], DAMAGE[damage][1])
    assert [p.name for p in tmp_path.iterdir()] == ["run"], line


@pytest.mark.parametrize("damage", DAMAGE)
@pytest.mark.parametrize("how", ["resume", "init_from"])
def test_training_from_checkpoints_whose_every_step_is_damaged_is_one_line(
    damage, how, trained, corpus, tmp_path, capsys
):
    """Resuming the run (or init_from=its checkpoints into a new run): one line naming
    both steps and the file, exit 2; the checkpoints are neither moved nor changed, and
    the new run gets no checkpoint."""
    run, files = _damaged_copy(trained, tmp_path, damage, [2, 4])
    before = _listing(run)
    target = run if how == "resume" else tmp_path / "new"
    extra = [f"init_from={run / 'checkpoints'}"] if how == "init_from" else []
    rc, _, err = call(
        "train",
        "--config",
        TINY_YAML,
        "--no-progress",
        *TINY_RUN_OVERRIDES,
        f"data.path={corpus}",
        f"run_dir={target}",
        "train.steps=6",
        "train.checkpoint_every=2",
        *extra,
        capsys=capsys,
    )
    line = one_line(rc, err, "step 4", "step 2", files[0], DAMAGE[damage][1])
    assert _listing(run) == before, line
    assert not (tmp_path / "run" / "checkpoints.damaged").exists()
    assert how == "resume" or not (tmp_path / "new" / "checkpoints").exists(), line
