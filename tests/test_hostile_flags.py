"""Every script's flags, walked from the parsers themselves (issue #28).

The flags of every script under scripts/ are read off its argparse parser (its `main` is
run up to `parse_args`), and each flag that takes a value must have an entry in
BAD_FLAG_VALUES: the values it must refuse (or a reason why no value of it is bad input).
A new flag without an entry fails `test_every_script_flag_is_in_the_table`; every listed
value must end in one line on stderr naming the flag, exit code 2, nothing written.
"""

import argparse
from pathlib import Path

import pytest

from helpers import call, one_line, script

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = sorted(p.stem for p in (ROOT / "scripts").glob("*.py"))

NEG_ZERO_NAN = ["-5", "0", "nan", "abc"]
# script -> {flag: the values it must refuse with one line naming it, or a string: why no
# value is bad input for it}
BAD_FLAG_VALUES: dict[str, dict[str, list[str] | str]] = {
    "bench_offload": {
        "--config": ["{missing}"],
        "--strategy": ["zero9"],
        "--rounds": NEG_ZERO_NAN,
        "--steps": NEG_ZERO_NAN,
    },
    "benchmark": {
        "--config": ["{missing}"],
        "--strategies": ["zero9", ","],
        "--steps": NEG_ZERO_NAN,
        "--warmup": ["-1", "1.5", "x"],
        "--sweep": ["devices=0", "devices=abc", "model.n_layers"],
        "--peak-tflops": ["-1", "0", "nan", "inf"],
        "--plot": ["{dir}", "{file}/x.png"],
    },
    "convert": {
        "--out": ["{dir}", "{file}", "{missing}/x/m.safetensors"],
        "--dtype": ["float8"],
        "--config-out": ["{dir}", "{file}", "{missing}/x/m.yaml"],
    },
    "export": {
        "--out": ["{dir}", "{missing}/x/m.safetensors"],
        "--hf": ["{dir}", "{file}"],
        "--peft": ["{dir}", "{file}"],
        "--max-shard-size": ["-5GB", "0", "lots", "1e400GB"],
        "--dtype": ["float8"],
        "--step": ["-1", "x"],
    },
    "gpu_check": {"--config": ["{missing}"], "--steps": NEG_ZERO_NAN, "--json": ["{dir}"], "--only": ["speed", ","]},
    "inspect": {
        "--config": ["{missing}"],
        "--devices": NEG_ZERO_NAN,
        "--strategy": ["zero9"],
        "--replicated-threshold": ["-1GB", "big", "1e400GB"],
        "--target": ["h9000"],
        "--hosts": ["0", "abc", "-2"],
        "--xla-flags": ["not_a_flag", "--xla_x"],
        "--slices": ["0", "abc", "-2"],
        "--topology": ["2x2x2", "x"],
        "--tpu-flags": ["maxtext-llama2-70b-v5p", "nonsense"],
    },
    "launch": {
        "--processes": ["0", "abc", "-1"],
        "--devices-per-process": ["0", "-1", "x"],
        "--port": ["-1", "70000", "x"],
        "--grace": ["-1", "nan", "inf"],
    },
    "measure_hf_import": {
        "--d-model": NEG_ZERO_NAN,
        "--layers": NEG_ZERO_NAN,
        "--vocab": NEG_ZERO_NAN,
        "--base-quant": ["nf8", "NF4"],
        "--child": "internal: the script's own child process",
    },
    "plan": {
        "--config": ["{missing}"],
        "--devices": NEG_ZERO_NAN,
        "--strategies": ["zero9", ","],
        "--device-memory": ["-5GB", "0", "lots", "1e400GB"],
        "--target": ["h9000"],
        "--hosts": ["0", "abc"],
        "--plot": ["{dir}", "{file}/x.png"],
        "--offload": ["everything"],
        "--slices": ["0", "abc"],
        "--topology": ["2x2x2", "3x"],
        "--tpu-flags": ["maxtext-llama2-70b-v5p", "nonsense"],
        # the --search flags (their values with --search: tests/test_search.py)
        "--remat": ["sometimes", ","],
        "--microbatches": ["0", "x"],
        "--vary": ["width"],
        "--attention": ["flash", ","],
        "--headroom": ["100%", "-5%", "lots"],
        "--host-memory": ["lots", "-1GB"],
        "--max-compiles": ["-1", "x"],
        "--rows": ["0", "x"],
        "--explain-time": ["0", "-3", "x", "26"],
        "--disk-gbps": ["0", "-1", "nan", "inf", "x"],
    },
    "plot": {"--out": ["{dir}", "{file}/x.png"]},
    "prepare": {
        "--out": ["{file}", "{file}/sub"],
        "--pattern": ["/etc/*", "../*"],
        "--val-fraction": ["2", "nan", "-0.1"],
        "--seed": ["-1", "x"],
        "--bin": ["{file}"],
        "--val-bin": "read with --bin only (test_hostile's script table)",
        "--vocab-size": ["0", "-3"],
        "--dtype": ["int8"],
        "--tokenizer": ["{missing}"],
        "--eos": ["{missing}"],
        "--threads": ["-3", "0"],
        "--model": ["{missing}"],
        "--pack": ["1", "0", "-4", "x"],
        "--overflow": ["wrap"],
        "--chat-template": ["{missing}"],
        "--workers": ["0", "-2", "x", "1.5"],
        "--text-key": ["", " "],
        "--messages-key": ["", "conversations"],  # (the latter: needs --pack)
        "--prompt-key": ["", "question"],
        "--completion-key": ["", "answer"],
    },
    "train": {"--config": ["{missing}", "{dir}"]},
    "verify": {
        "--config": ["{missing}"],
        "--strategies": ["zero9"],
        "--devices": NEG_ZERO_NAN,
        "--steps": NEG_ZERO_NAN,
        "--seed": ["-1", "x"],
        "--max-params": ["-5", "nan", "inf", "x"],
    },
}

# The other flags a script needs to get as far as checking the one under test.
BASE_ARGS: dict[str, list[str]] = {
    "bench_offload": ["--config", "configs/tiny.yaml"],
    "benchmark": ["--config", "configs/tiny.yaml"],
    "convert": ["tests/golden/hf/llama_gqa", "--out", "{new}/m.safetensors"],
    "export": ["{dir}", "--out", "{new}/m.safetensors"],
    "gpu_check": ["--only", "throughput"],
    "inspect": ["--config", "configs/tiny.yaml", "--devices", "8"],
    "launch": ["--processes", "2"],
    "measure_hf_import": [],
    "plan": ["--config", "configs/tiny.yaml", "--devices", "8"],
    "plot": ["{run}"],
    "prepare": ["--out", "{new}/d", "{src}"],
    "train": [],
    "verify": ["--config", "configs/tiny.yaml"],
}
TAIL_ARGS = {"launch": ["--", "true"]}
# flags whose range check another open issue adds (remove the entry once it is merged)
PENDING: dict = {}  # (script, flag) -> why its range is not checked yet


class _Parsed(Exception):
    pass


def value_flags(name: str) -> dict[str, argparse.Action]:
    """{option string: action} of every flag of scripts/<name>.py that takes a value."""
    seen = {}

    def grab(self, *a, **k):
        seen["parser"] = self
        raise _Parsed

    real = argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args
    argparse.ArgumentParser.parse_args = argparse.ArgumentParser.parse_known_args = grab
    try:
        script(name).main(["--help"] if name != "launch" else ["--", "true"])
    except _Parsed:
        pass
    finally:
        argparse.ArgumentParser.parse_args, argparse.ArgumentParser.parse_known_args = real
    assert "parser" in seen, f"scripts/{name}.py: main() did not build an argparse parser"
    out = {}
    for action in seen["parser"]._actions:
        if action.option_strings and action.nargs != 0 and not isinstance(action, argparse._HelpAction):
            out[max(action.option_strings, key=len)] = action
    return out


def test_every_script_flag_is_in_the_table():
    assert sorted(BAD_FLAG_VALUES) == SCRIPTS, "add the new script to BAD_FLAG_VALUES and BASE_ARGS"
    for name in SCRIPTS:
        flags = value_flags(name)
        missing = sorted(set(flags) - set(BAD_FLAG_VALUES[name]))
        assert not missing, f"scripts/{name}.py: add bad values for {missing} to BAD_FLAG_VALUES"
        stale = sorted(set(BAD_FLAG_VALUES[name]) - set(flags))
        assert not stale, f"scripts/{name}.py has no flags {stale}"


def test_every_numeric_flag_has_a_range():
    """A flag parsed as a number says its range in the parser (fsdp_jax.app.cli.flags): a bare
    `type=int` takes -5 (the issue's `verify.py --max-params -5`). prepare.py checks
    its numbers itself (issue 25 owns that script)."""
    bare = [
        (name, flag)
        for name in SCRIPTS
        for flag, a in value_flags(name).items()
        if a.type in (int, float) and name != "prepare"
    ]
    assert not bare, f"use fsdp_jax.app.cli.flags.int_in / real_in for {bare}"


def _fill(args, tmp_path):
    subs = {
        "{dir}": str(tmp_path / "a_dir"),
        "{file}": str(tmp_path / "a_file"),
        "{missing}": str(tmp_path / "missing"),
        "{new}": str(tmp_path / "new"),
        "{run}": str(tmp_path / "run"),
        "{src}": str(tmp_path / "src"),
    }
    out = []
    for a in args:
        for k, v in subs.items():
            a = a.replace(k, v)
        out.append(a)
    return out


@pytest.mark.parametrize("name", SCRIPTS)
def test_every_script_flag_refuses_its_bad_values(name, tmp_path, capsys):
    (tmp_path / "a_dir").mkdir()
    (tmp_path / "a_file").write_text("x")
    (tmp_path / "new").mkdir()
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("some text to tokenize\n" * 50)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    n, failures = 0, []
    for flag, values in BAD_FLAG_VALUES[name].items():
        if isinstance(values, str) or (name, flag) in PENDING:
            continue
        for v in values:
            args = _fill(BASE_ARGS[name] + [flag, v] + TAIL_ARGS.get(name, []), tmp_path)
            rc, _, err = call(name, *args, capsys=capsys)
            filled = _fill([v], tmp_path)[0]
            try:
                line = one_line(rc, err)
                assert flag in line or filled in line, f"names neither {flag} nor {filled!r}"
            except AssertionError as e:
                failures.append(f"{name} {flag} {v}: {str(e)[-300:]}")
            n += 1
    assert not failures, "\n".join(failures)
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    assert n >= 1
