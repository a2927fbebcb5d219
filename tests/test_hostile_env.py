"""The environment a script starts in (issue #28): XLA_FLAGS entries XLA does not know,
and paths written with `~`.

XLA parses XLA_FLAGS when a process starts its first backend and aborts the process with a
fatal log on an entry its build does not register; every script that computes in its own
process checks the flags first (`fsdp_jax.targets.xla_flags.check_xla_flags`, a ~0.2 s child that
starts only jaxlib's CPU client) and says so in one line, exit 2, before writing anything.
"""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_jax.app import config as config_lib
from fsdp_jax.app.trainer.setup import load_run_config
from fsdp_jax.targets import xla_flags
from helpers import TINY_RUN_OVERRIDES, call, one_line

ROOT = Path(__file__).resolve().parents[1]
BAD_FLAG = "--xla_no_such_flag_fsdp_jax=1"


def test_check_xla_flags_names_the_entry_before_a_backend_starts(monkeypatch):
    from jax._src import xla_bridge

    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: False)
    monkeypatch.setattr(xla_flags, "_probed", {})
    env = dict(os.environ, XLA_FLAGS=f"--xla_backend_optimization_level=0 {BAD_FLAG}")
    with pytest.raises(xla_flags.XlaFlagsError, match=f"XLA_FLAGS: .*{BAD_FLAG}"):
        xla_flags.check_xla_flags(env)
    # flags XLA knows (a GPU one too: one registry) pass; an unset XLA_FLAGS probes nothing
    xla_flags.check_xla_flags(
        dict(os.environ, XLA_FLAGS="--xla_gpu_enable_latency_hiding_scheduler=true --xla_backend_optimization_level=0")
    )
    xla_flags.check_xla_flags({})
    assert len(xla_flags._probed) == 2
    # once the backend runs, XLA has read the flags: no probe
    monkeypatch.setattr(xla_bridge, "backends_are_initialized", lambda: True)
    xla_flags.check_xla_flags(dict(os.environ, XLA_FLAGS="--xla_other_unknown=2"))
    assert len(xla_flags._probed) == 2


def test_unknown_flag_parses_xla_fatal_line():
    err = (
        "I1130 pjrt_client.cc:579] PjRt-IFRT device count\n"
        "F1130 20:32:05.635319    5288 parse_flags_from_env.cc:234] Unknown flag in XLA_FLAGS: --xla_x=1\n"
    )
    assert xla_flags.unknown_flag(err) == "--xla_x=1"
    assert xla_flags.unknown_flag("F1130 something else\n") is None


@pytest.mark.slow
def test_unknown_xla_flag_in_every_computing_script_is_one_line_exit_2(tmp_path, corpus):
    """As a user runs them (a fresh process each): XLA's fatal log (exit 134, no line
    naming the input) before; one line naming the entry, exit 2, nothing written now. And before
    JAX loads (`run_command(computes=True)`): the same commands in one more child, through the
    `fsdp-jax` entry, leave `jax` unloaded (a refusal child costs ~0.3 s of CPU, not ~2.5 s)."""
    tiny = str(ROOT / "configs" / "tiny.yaml")
    ckpts = tmp_path / "ckpts"
    ckpts.mkdir()
    table = {
        "train.py": [
            "--config",
            tiny,
            "--no-progress",
            *TINY_RUN_OVERRIDES,
            f"data.path={corpus}",
            f"run_dir={tmp_path / 'run'}",
        ],
        "plan.py": ["--config", tiny, "--devices", "8"],
        "inspect.py": ["--config", tiny, "--devices", "8"],
        "verify.py": ["--config", tiny],
        "benchmark.py": ["--config", tiny, "--steps", "1"],
        "bench_offload.py": ["--config", tiny],
        "export.py": [str(ckpts), "--out", str(tmp_path / "m.safetensors")],
        "convert.py": [str(ROOT / "tests/golden/hf/llama_gqa"), "--out", str(tmp_path / "c.safetensors")],
    }
    env = dict(
        os.environ,
        PYTHONPATH=str(ROOT),
        JAX_PLATFORMS="cpu",
        XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {BAD_FLAG}".strip(),
    )
    failures = []
    for name, args in table.items():
        r = subprocess.run(
            [sys.executable, str(ROOT / "scripts" / name), *args],
            capture_output=True,
            text=True,
            env=env,
            cwd=tmp_path,
            timeout=300,
        )
        try:
            one_line(r.returncode, r.stderr, "XLA_FLAGS", BAD_FLAG)
        except AssertionError as e:
            failures.append(f"{name}: {str(e)[-400:]}")
    assert not failures, "\n".join(failures)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpts"]
    argvs = [[name.removesuffix(".py").replace("_", "-"), *map(str, args)] for name, args in table.items()]
    code = (
        "import json, sys; from fsdp_jax.app.cli import entry\n"
        "codes = [entry.main(argv) for argv in json.loads(sys.argv[1])]\n"
        "print(json.dumps([codes, sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'flax'))]))"
    )
    r = subprocess.run(
        [sys.executable, "-c", code, json.dumps(argvs)], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads(r.stdout.splitlines()[-1]) == [[2] * len(table), []], r.stderr[-3000:]
    assert len(r.stderr.splitlines()) == len(table) and all(BAD_FLAG in l for l in r.stderr.splitlines()), r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpts"]


# -- paths written with ~ ---------------------------------------------------------------------------


def test_tilde_in_path_keys_is_expanded(tmp_path, monkeypatch, corpus):
    home = tmp_path / "home"
    home.mkdir()
    shutil.copytree(corpus, home / "data")
    shutil.copytree(ROOT / "tests/golden/hf/llama_gqa", home / "hf")
    monkeypatch.setenv("HOME", str(home))
    tiny = ROOT / "configs" / "tiny.yaml"
    cfg = load_run_config(tiny, ["run_dir=~/run", "data.path=~/data"])
    assert (cfg.run_dir, cfg.data.path) == (str(home / "run"), str(home / "data"))
    bare = tmp_path / "bare.yaml"
    bare.write_text("{}\n")
    cfg = load_run_config(bare, ["init_from=hf:~/hf", "data.seq_len=32"])
    assert cfg.init_from == f"hf:{home / 'hf'}" and cfg.model.n_kv_heads == 2  # read from ~/hf/config.json
    (home / "m.safetensors").write_bytes((home / "hf" / "model-00001-of-00006.safetensors").read_bytes())
    assert load_run_config(tiny, ["init_from=~/m.safetensors"]).init_from == str(home / "m.safetensors")
    # in a YAML file too, and the written config.yaml holds the expanded path
    f = tmp_path / "c.yaml"
    f.write_text("run_dir: ~/r2\ndata:\n  path: ~/data\n")
    cfg = load_run_config(f)
    assert (cfg.run_dir, cfg.data.path) == (str(home / "r2"), str(home / "data"))
    assert config_lib.config_from_dict({"run_dir": "~/r3"}).run_dir == str(home / "r3")


@pytest.mark.slow
def test_train_with_a_tilde_run_dir_writes_under_home(tmp_path, monkeypatch, corpus, capsys):
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(tmp_path)
    rc, _, err = call(
        "train",
        "--config",
        ROOT / "configs" / "tiny.yaml",
        "--no-progress",
        *TINY_RUN_OVERRIDES,
        "train.steps=1",
        f"data.path={corpus}",
        "run_dir=~/run",
        capsys=capsys,
    )
    assert rc == 0, err
    assert (home / "run" / "config.yaml").is_file()
    assert not (ROOT / "~").exists() and not (tmp_path / "~").exists()
