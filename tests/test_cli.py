"""The command-line package (fsdp_jax/app/cli): `fsdp-jax <command>`, the scripts/ shims over
the same commands, the one parser and the one main wrapper's exit codes."""

import ast
import importlib
import json
import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from test_hostile_flags import BAD_FLAG_VALUES, BASE_ARGS, TAIL_ARGS, _fill

from fsdp_jax.app.cli import command as command_lib
from fsdp_jax.app.cli import entry
from fsdp_jax.app.cli.flags import Parser
from fsdp_jax.errors import UsageError
from helpers import one_line

ROOT = Path(__file__).resolve().parents[1]
SHIMS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py"))


def run_entry(argv, capsys):
    """(exit code, stdout, stderr) of the `fsdp-jax` console entry called with `argv`, in process."""
    capsys.readouterr()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc = entry.main([str(a) for a in argv])
    finally:
        os.chdir(cwd)
    out, err = capsys.readouterr()
    return rc, out, err


# ----------------------------------------------------------------------------- help


@pytest.mark.parametrize("command", list(entry.COMMANDS))
def test_every_command_has_help(command, capsys):
    rc, out, err = run_entry([command, "--help"], capsys)
    assert rc == 0 and not err
    assert out.startswith(f"usage: fsdp-jax {command} ")
    module = entry.command_module(command)
    assert module.__doc__.split("\n")[0] in out  # the command's own description


# what loads before the body: the CLI's start-up boundary (command.run_command, fsdp_jax.app.cli.run)
HEAVY = ("jax", "jaxlib", "flax", "optax", "orbax", "grain", "tensorstore", "fsdp_jax.train")


# a refusal after parsing per command that reads a config (`args.config_before_jax`), each kind
# the config's bad-input rules name: a missing file, a bad override, an unknown key, a bad value
# (type, limit, choice, mesh rule). gpu-check reads its config only for --only throughput
# (`gpu_check.check_flags`).
CONFIG = ["--config", "configs/tiny.yaml"]
REFUSED_CONFIGS = {
    "train": ["--config", "no/such.yaml"],
    "plan": [*CONFIG, "--devices", "8", "train.stepz=1"],
    "inspect": [*CONFIG, "model.rope_type=ntk"],
    "verify": [*CONFIG, "mesh.rules.mlp=bogus"],
    "benchmark": [*CONFIG, "no_equals_sign"],
    "bench-offload": [*CONFIG, "train.steps=-1"],
    "gpu-check": [*CONFIG, "--only", "throughput", "model.attention=bogus"],
}
# refusals of flags after parsing, before JAX (the command's `before`): gpu-check's --json, and
# plan's flags up to its first check that needs the library (`flag_values.check_plan_flags`),
# inspect's up to building a --target, verify's --devices, prepare's flags and --out
REFUSED_FLAGS = {
    "--json: '.' is a directory": ["gpu-check", "--only", "precision", "--json", "."],
    "--rows: only with --search": ["plan", *CONFIG, "--devices", "8", "--rows", "3"],
    "--hosts: '2' needs --target": ["plan", *CONFIG, "--devices", "8", "--hosts", "2"],
    "--devices: 0 must be in 1..": ["plan", *CONFIG, "--devices", "0"],
    "--devices: give the number": ["plan", *CONFIG],
    "--explain-time: only with --target": ["plan", *CONFIG, "--devices", "8", "--explain-time"],
    "--device-memory": ["plan", *CONFIG, "--devices", "8", "--device-memory", "lots"],
    "--slices: '2' needs --target": ["inspect", *CONFIG, "--slices", "2"],
    "--devices: 'abc' is not an integer": ["inspect", *CONFIG, "--devices", "abc"],
    "--devices: -5 must be in 1..": ["verify", *CONFIG, "--devices", "-5"],
    "--out 'README.md' is a file": ["prepare", "--out", "README.md", "configs"],
    "--val-fraction 2.0: must be in": ["prepare", "--out", "x", "--stdlib", "--val-fraction", "2"],
    # plan without --target: --strategies, --offload, --plot, --host-memory; verify's --strategies,
    # bench-offload's --strategy
    "--strategies: unknown strategy 'zero9'": ["plan", *CONFIG, "--devices", "8", "--strategies", "zero9"],
    "--offload: 'everything' is not one of": ["plan", *CONFIG, "--devices", "8", "--offload", "everything"],
    "--plot: '.' is a directory": ["plan", *CONFIG, "--devices", "8", "--plot", "."],
    "--host-memory: 'lots' is not a size": ["plan", *CONFIG, "--devices", "8", "--host-memory", "lots"],
    "--strategies: ',' names no strategy": ["verify", *CONFIG, "--strategies", ","],
    "--strategy: unknown strategy 'zero9'": ["bench-offload", *CONFIG, "--strategy", "zero9"],
}
# refusals of the checks across the config's fields that need no JAX (`config.early_checks`, run by
# `args.config_agrees_before_jax` after each command's own flag checks), one per kind: heads, the
# decoder's switches, MoE, the data fields, run_dir, the mesh, remat, offload, distributed, precision,
# train, MTP, FP8, cuDNN attention's compute dtype (LoRA against the decoder still loads JAX)
REFUSED_ACROSS = {
    "model.n_kv_heads: 3 is invalid": ["train", *CONFIG, "model.n_kv_heads=3"],
    "model.global_every: 2 is invalid": ["verify", *CONFIG, "model.global_every=2"],
    "model.experts_per_token: 5 is invalid": [
        "inspect",
        *CONFIG,
        "--devices",
        "8",
        "model.n_experts=4",
        "model.experts_per_token=5",
    ],
    "data.seq_len: 100000 is invalid": ["plan", *CONFIG, "--devices", "8", "data.seq_len=100000"],
    "run_dir: '' is invalid": ["train", *CONFIG, "run_dir="],
    "mesh.strategy: 'zero9' is invalid": ["gpu-check", *CONFIG, "--only", "throughput", "mesh.strategy=zero9"],
    # the policies (`config.policy_checks`), multi-token prediction, FP8, cuDNN attention's compute dtype
    "remat: 'bogus' is invalid": ["train", *CONFIG, "remat=bogus"],
    "offload: 'bogus' is invalid": ["plan", *CONFIG, "--devices", "8", "offload=bogus"],
    "offload: 'optimizer:streamed' is invalid": [
        "inspect",
        *CONFIG,
        "--devices",
        "8",
        "offload=optimizer:streamed",
        "optimizer.name=adafactor",
    ],
    "distributed.coordinator: 'nohost' is invalid": ["train", *CONFIG, "distributed.coordinator=nohost"],
    "precision: 'bogus' is invalid": ["verify", *CONFIG, "precision=bogus"],
    "train.profile: '5:1' is invalid": ["train", *CONFIG, "train.profile=5:1"],
    "train.global_batch: 16 is invalid": ["gpu-check", *CONFIG, "--only", "throughput", "train.microbatches=3"],
    "model.mtp_depth: 1 is invalid": ["train", *CONFIG, "model.mtp_depth=1", "objective=dpo"],
    "lora.rank: 4 is invalid; must be 0 with precision matmul=fp8": [
        "train",
        *CONFIG,
        "precision=params=float32,compute=bfloat16,matmul=fp8",
        "lora.rank=4",
    ],
    "model.attention: 'cudnn' is invalid": ["plan", *CONFIG, "--devices", "8", "model.attention=cudnn"],
    "precision: 'fp64' is invalid": ["bench-offload", *CONFIG, "precision=fp64"],
}


@pytest.mark.slow
def test_help_and_refusals_load_no_jax():
    """Every command's --help, a flag its parser refuses, and a config refused after parsing
    (`REFUSED_CONFIGS`), answered before JAX, Flax, Orbax or the library's train step load:
    ~0.15 s of CPU for such a child, where one that loads them pays ~3.3 s. One fresh child for
    all (a module once loaded stays loaded, so what loads shows at the end); then a refusal of the
    body's (LoRA targets the decoder lacks: `checks.validate`), which loads the library first,
    without IPython."""
    code = (
        "import sys; from fsdp_jax.app.cli import entry\n"
        "for c in entry.COMMANDS:\n"
        "    assert (entry.main([c, '--help']), entry.main([c, '--no-such-flag'])) == (0, 2), c\n"
        f"for c, argv in {REFUSED_CONFIGS!r}.items():\n"
        "    assert entry.main([c, *argv]) == 2, c\n"
        f"for argv in {list(REFUSED_FLAGS.values()) + list(REFUSED_ACROSS.values())!r}:\n"
        "    assert entry.main(argv) == 2, argv\n"
        f"print(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY!r} or m.startswith({HEAVY!r})))\n"
        # a body that runs loads the face first, as `import fsdp_jax` did: Flax without IPython
        "assert entry.main(['train', '--config', 'configs/tiny.yaml', 'lora.targets=bogus']) == 2\n"
        "print('IPython' in sys.modules, 'jax' in sys.modules)"
    )
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.splitlines()[-2:] == ["[]", "False True"]
    lines = r.stderr.splitlines()  # one line per refusal, nothing else
    assert len(lines) == len(entry.COMMANDS) + len(REFUSED_CONFIGS) + len(REFUSED_FLAGS) + len(REFUSED_ACROSS) + 1, (
        lines
    )
    assert all(line.startswith("error: ") for line in lines), lines
    words = ["config file not found", "train.stepz: unknown key", "model.rope_type: 'ntk' is invalid"]
    words += ["mesh.rules.mlp: 'bogus' is invalid", "override: 'no_equals_sign' is not key=value"]
    words += [
        "train.steps: -1 is invalid",
        "lora.targets: bogus matches no weight",
        "model.attention: 'bogus' is invalid",
    ]
    words += list(REFUSED_FLAGS) + list(REFUSED_ACROSS)
    assert [w for w in words if not any(w in line for line in lines)] == []
    with_config = {
        c for c in entry.COMMANDS if "--config CONFIG" in entry.command_module(c).build_parser().format_usage()
    }
    assert with_config == set(REFUSED_CONFIGS)


def test_top_level_help_lists_every_command(capsys):
    rc, out, err = run_entry(["--help"], capsys)
    assert rc == 0 and not err
    listed = [line.split()[0] for line in out.split("commands:\n")[1].splitlines() if line.startswith("  ")]
    assert listed == list(entry.COMMANDS)


@pytest.mark.parametrize(
    "argv, words",
    [
        ([], "required: COMMAND"),
        (["trian"], "invalid choice: 'trian'"),
        (["--bogus"], "required: COMMAND"),
        (["train", "--bogus", "--config", "configs/tiny.yaml"], "unrecognized arguments: --bogus"),
        (["plan"], "required: --config"),
        (["export", "run"], "one of the arguments --out --hf --peft is required"),
    ],
)
def test_entry_usage_errors_are_one_line_exit_2(argv, words, capsys):
    rc, out, err = run_entry(argv, capsys)
    assert words in one_line(rc, err) and not out


# ----------------------------------------------------------------------------- bad flags, both ways


def _first_bad_values():
    """(script, command, flag, value, argv) for the first bad value of every flag of every script
    (tests/test_hostile_flags.py's table)."""
    for script, table in BAD_FLAG_VALUES.items():
        for flag, values in table.items():
            if not isinstance(values, str):
                yield (
                    script,
                    entry.SCRIPTS[script],
                    flag,
                    values[0],
                    BASE_ARGS[script] + [flag, values[0]] + TAIL_ARGS.get(script, []),
                )


BAD = list(_first_bad_values())


@pytest.mark.parametrize("script, command, flag, value, argv", BAD, ids=[f"{b[1]}{b[2]}" for b in BAD])
def test_bad_flags_through_the_entry_are_one_line_exit_2(script, command, flag, value, argv, tmp_path, capsys):
    """Every flag's bad value, given to `fsdp-jax <command>`: one line naming it, exit 2,
    nothing written, and the same line the script's main gives."""
    for d in ("a_dir", "new", "run", "src"):
        (tmp_path / d).mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "src" / "a.txt").write_text("some text to tokenize\n" * 50)
    args = _fill(argv, tmp_path)
    before = sorted(tmp_path.rglob("*"))
    rc, _, err = run_entry([command, *args], capsys)
    line = one_line(rc, err)
    assert flag in line or _fill([value], tmp_path)[0] in line, line
    assert sorted(tmp_path.rglob("*")) == before
    # the module behind scripts/<script>.py, called as the script calls it
    capsys.readouterr()
    cwd = os.getcwd()
    os.chdir(ROOT)
    try:
        rc2 = entry.script_main(script, args)
    finally:
        os.chdir(cwd)
    assert (rc2, capsys.readouterr().err) == (rc, err)


# ----------------------------------------------------------------------------- the shims


def test_every_script_is_a_shim_over_its_command():
    """scripts/<name>.py imports `main` from the command's module and calls it: nothing else."""
    assert sorted(entry.SCRIPTS) == SHIMS, "add the script to fsdp_jax.app.cli.entry.SCRIPTS"
    assert set(entry.SCRIPTS.values()) == set(entry.COMMANDS)
    for command, (module, _) in entry.COMMANDS.items():  # one word: command = module = script
        assert module == command.replace("-", "_"), command
    for name in SHIMS:
        text = (ROOT / "scripts" / f"{name}.py").read_text()
        tree = ast.parse(text)
        imports = [n for n in tree.body if isinstance(n, ast.ImportFrom)]
        module = f"fsdp_jax.app.cli.{entry.COMMANDS[entry.SCRIPTS[name]][0]}"
        assert [(i.module, [a.name for a in i.names]) for i in imports] == [(module, ["main"])], name
        assert len([n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]) == 0, name
        assert len(text.splitlines()) <= 12, name


def test_one_parser_class_and_one_use_cpu_devices():
    """The argparse subclass and `use_cpu_devices` are defined once (fsdp_jax/app/cli)."""
    sources = [p for d in ("fsdp_jax", "scripts", "examples", "benchmarks") for p in (ROOT / d).rglob("*.py")]
    parsers, devices = [], []
    for p in sources:
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ClassDef) and any(
                getattr(b, "attr", getattr(b, "id", "")) == "ArgumentParser" for b in node.bases
            ):
                parsers.append(f"{p.relative_to(ROOT)}:{node.name}")
            if isinstance(node, ast.FunctionDef) and node.name == "use_cpu_devices":
                devices.append(str(p.relative_to(ROOT)))
    assert parsers == ["fsdp_jax/app/cli/flags.py:Parser"]
    assert devices == ["fsdp_jax/app/devices.py"]


# one child runs the declared `fsdp-jax` entry point for every script's case, as pip's console-script
# wrapper calls it (sys.argv[0] = 'fsdp-jax', `sys.exit(func())`), each case's stdout and stderr taken
# at the file descriptors: {script: [exit code, stdout, stderr]}
_CONSOLE = """
import json, os, sys, tempfile
from {module} import {func}
out = {{}}
for script, argv in json.loads(sys.argv[1]).items():
    with tempfile.TemporaryFile() as o, tempfile.TemporaryFile() as e:
        sys.stdout.flush(); sys.stderr.flush()
        saved = os.dup(1), os.dup(2)
        os.dup2(o.fileno(), 1); os.dup2(e.fileno(), 2)
        sys.argv = ["fsdp-jax", *argv]
        try:
            sys.exit({func}())
        except SystemExit as x:
            rc = x.code
        sys.stdout.flush(); sys.stderr.flush()
        os.dup2(saved[0], 1); os.dup2(saved[1], 2)
        o.seek(0); e.seek(0)
        out[script] = [rc, o.read().decode(), e.read().decode()]
print(json.dumps(out))
"""


def _shim_args(script, where: Path) -> list[str]:
    """The first bad value of `script`'s first flag that has one (tests/test_hostile_flags.py's table)."""
    flag, values = next((f, v) for f, v in BAD_FLAG_VALUES[script].items() if not isinstance(v, str))
    return _fill(BASE_ARGS[script] + [flag, values[0]] + TAIL_ARGS.get(script, []), where)


@pytest.fixture(scope="module")
def shim_dir(tmp_path_factory):
    """The paths the shim cases name (nothing is written: each case is refused)."""
    where = tmp_path_factory.mktemp("shims")
    for d in ("a_dir", "new", "run", "src"):
        (where / d).mkdir()
    (where / "a_file").write_text("x")
    (where / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (where / "src" / "a.txt").write_text("some text\n" * 50)
    return where


@pytest.fixture(scope="module")
def console_results(shim_dir):
    """{script: (exit code, stdout, stderr)} of `fsdp-jax <command> <bad flag>` for every script, from the
    declared entry point in one fresh process (`_CONSOLE`; a child per script cost ~1.5-30 s each)."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["fsdp-jax"]
    module, func = target.split(":")
    cases = {script: [entry.SCRIPTS[script], *_shim_args(script, shim_dir)] for script in SHIMS}
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    r = subprocess.run(
        [sys.executable, "-c", _CONSOLE.format(module=module, func=func), json.dumps(cases)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert r.returncode == 0 and not r.stderr.strip(), r.stderr[-2000:]
    return {script: tuple(v) for script, v in json.loads(r.stdout).items()}


@pytest.mark.slow
@pytest.mark.parametrize("script", SHIMS)
def test_the_shim_and_the_console_entry_give_the_same_exit_and_line(script, shim_dir, console_results):
    """`python scripts/X.py <bad flag>` (a fresh process per script: its `__main__` entry and exit
    code through the process boundary) and `fsdp-jax <command> <bad flag>` (the declared entry point,
    all scripts' cases in one fresh process: `console_results`): the same exit code 2, the same one
    line, the same stdout."""
    args = _shim_args(script, shim_dir)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    shim = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / f"{script}.py"), *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert (shim.returncode, shim.stdout, shim.stderr) == console_results[script]
    one_line(shim.returncode, shim.stderr)


def _console_here(monkeypatch, capfd, *args):
    """(exit code, stdout, stderr) of the declared `fsdp-jax` entry point called as pip's wrapper
    calls it (sys.argv[0] = 'fsdp-jax', `sys.exit(func())`), in this process: the output is taken
    at the file descriptors. A fresh process per command is the shim test's (above)."""
    target = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]["fsdp-jax"]
    module, func = target.split(":")
    monkeypatch.setattr(sys, "argv", ["fsdp-jax", *map(str, args)])
    capfd.readouterr()
    try:
        rc = getattr(importlib.import_module(module), func)()
    except SystemExit as e:
        rc = e.code
    out, err = capfd.readouterr()
    return rc, out, err


def test_console_entry_help_and_unknown_command(monkeypatch, capfd):
    """In process (as three children it cost ~9 s CPU; the declared entry runs in fresh processes
    in the shim test). Mutations of `entry.main` run against it: the unknown-command branch
    returning 1 (fails on the exit code), the command's prog without 'fsdp-jax' (fails on
    verify's usage line)."""
    rc, out, _ = _console_here(monkeypatch, capfd, "--help")
    assert rc == 0 and "usage: fsdp-jax" in out and "measure-hf-import" in out
    rc, _, err = _console_here(monkeypatch, capfd, "nope")
    assert one_line(rc, err).startswith("error: argument COMMAND: invalid choice: 'nope'")
    rc, out, _ = _console_here(monkeypatch, capfd, "verify", "--help")
    assert rc == 0 and out.startswith("usage: fsdp-jax verify ")


# ----------------------------------------------------------------------------- the main wrapper


def _raise(e):
    def body(args):
        raise e

    return body


def _make(kind, msg):
    from fsdp_jax.checkpoint import CheckpointError, CheckpointWriteError
    from fsdp_jax.errors import ConfigError, RunDirBusy

    return {
        "config": ConfigError("train.steps", msg),
        "checkpoint": CheckpointError(msg),
        "missing": FileNotFoundError(msg),
        "usage": UsageError(msg),
        "write": CheckpointWriteError(msg),
        "busy": RunDirBusy(msg),
        "disk": OSError(28, msg),
        "bug": IndexError(msg),
        "oom": RuntimeError(f"RESOURCE_EXHAUSTED: {msg}"),
    }[kind]


# kind of exception -> exit code (2: the user's input; 1: the environment or a bug)
WRAPPER_TABLE = [
    ("config", 2),
    ("checkpoint", 2),
    ("missing", 2),
    ("usage", 2),
    ("write", 1),
    ("busy", 1),
    ("disk", 1),
    ("bug", 1),
    ("oom", 1),
]


@pytest.mark.parametrize("kind, code", WRAPPER_TABLE)
def test_run_command_maps_what_the_body_raises_to_one_line_and_its_exit_code(kind, code, capsys, monkeypatch):
    monkeypatch.delenv("FSDP_JAX_TRACEBACK", raising=False)
    rc = command_lib.run_command(Parser(prog="t"), _raise(_make(kind, "it went\nwrong here")), [])
    err = capsys.readouterr().err
    assert "it went wrong here" in one_line(rc, err, code=code)
    if kind == "bug":
        assert "IndexError" in err and "FSDP_JAX_TRACEBACK=1" in err


def test_run_command_takes_a_commands_own_error_classes(capsys):
    class Mine(RuntimeError):
        pass

    errors = lambda: ((Mine,), ())  # noqa: E731
    assert command_lib.run_command(Parser(), _raise(Mine("bad thing")), [], errors=errors) == 2
    assert capsys.readouterr().err == "error: bad thing\n"
    errors = lambda: ((), (Mine,))  # noqa: E731
    assert command_lib.run_command(Parser(), _raise(Mine("gone")), [], errors=errors) == 1
    assert capsys.readouterr().err == "error: gone\n"


def test_run_command_traceback_on_request(monkeypatch):
    monkeypatch.setenv("FSDP_JAX_TRACEBACK", "1")
    with pytest.raises(KeyError):
        command_lib.run_command(Parser(), _raise(KeyError("x")), [])


def test_parser_errors_never_reach_the_body(capsys):
    ap = Parser()
    ap.add_argument("--n", type=int, required=True)
    called = []
    assert command_lib.run_command(ap, called.append, ["--n", "x"]) == 2
    assert one_line(2, capsys.readouterr().err).startswith("error: argument --n: invalid int value")
    assert command_lib.run_command(ap, lambda a: called.append(a) or 0, ["--help"]) == 0
    assert not called
