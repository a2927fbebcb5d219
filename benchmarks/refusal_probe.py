"""Which CLI refusals load JAX before they refuse: each bad input of the tests' tables
(tests/test_hostile_flags.py `BAD_FLAG_VALUES`, tests/test_cli.py's `REFUSED_*`, and the
checks across a config's fields that `checks.validate` runs after the JAX-free ones) run by
`fsdp-jax`'s entry in a child forked from a parent that has not loaded JAX; the child prints its
exit code, whether `jax` was in `sys.modules` when the command returned, and its one line.

    cd <checkout>; PYTHONPATH=$PWD python benchmarks/refusal_probe.py [--all] [--jax-only] [--across] [--save F]

Without `--all` each flag's first bad value only (what the shim-vs-console test runs in
children); `--across`: the `ACROSS` table only; `--save`: every case's exit code, JAX loaded and
whole stderr as JSON (to compare two trees' lines). A fork costs what the refusal costs: ~0.01 s before JAX, ~2-3 s after.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ["--config", "configs/tiny.yaml"]

# the checks across fields after the JAX-free ones (`checks.validate`'s order), one bad input each
ACROSS = {
    "remat": ["train", *CONFIG, "remat=bogus"],
    "offload": ["train", *CONFIG, "offload=bogus"],
    "offload+adafactor": ["train", *CONFIG, "offload=optimizer:streamed", "optimizer.name=adafactor"],
    "distributed": ["train", *CONFIG, "distributed.coordinator=nohost"],
    "precision": ["train", *CONFIG, "precision=bogus"],
    "train.profile": ["train", *CONFIG, "train.profile=5:1"],
    "train.global_batch": ["train", *CONFIG, "train.microbatches=3"],
    "lora.targets": ["train", *CONFIG, "lora.rank=4", "lora.targets=bogus"],
    "lora.rank": ["train", *CONFIG, "lora.rank=100000"],
    "mtp": ["train", *CONFIG, "model.mtp_depth=1", "objective=dpo"],
    "fp8": ["train", *CONFIG, "precision=params=float32,compute=bfloat16,matmul=fp8", "lora.rank=4"],
    "attention precision": ["train", *CONFIG, "model.attention=cudnn"],
    "plan --strategies": ["plan", *CONFIG, "--devices", "8", "--strategies", "zero9"],
    "plan --offload": ["plan", *CONFIG, "--devices", "8", "--offload", "everything"],
    "plan --target": ["plan", *CONFIG, "--devices", "8", "--target", "h9000"],
    "plan remat=bogus": ["plan", *CONFIG, "--devices", "8", "remat=bogus"],
    "inspect remat=bogus": ["inspect", *CONFIG, "--devices", "8", "remat=bogus"],
    "verify remat=bogus": ["verify", *CONFIG, "remat=bogus"],
    "plan --plot": ["plan", *CONFIG, "--devices", "8", "--plot", "."],
    "plan --host-memory": ["plan", *CONFIG, "--devices", "8", "--host-memory", "lots"],
    "plan --strategies ,": ["plan", *CONFIG, "--devices", "8", "--strategies", ","],
    "verify --strategies": ["verify", *CONFIG, "--strategies", "zero9"],
    "plan offload=bogus": ["plan", *CONFIG, "--devices", "8", "offload=bogus"],
    "inspect adafactor": [
        "inspect",
        *CONFIG,
        "--devices",
        "8",
        "offload=optimizer:streamed",
        "optimizer.name=adafactor",
    ],
    "verify precision": ["verify", *CONFIG, "precision=bogus"],
    "gpu-check microbatches": ["gpu-check", *CONFIG, "--only", "throughput", "train.microbatches=3"],
    "plan cudnn": ["plan", *CONFIG, "--devices", "8", "model.attention=cudnn"],
    "mtp context": ["train", *CONFIG, "model.mtp_depth=1", "mesh.context=2"],
    "fp8 gather": [
        "train",
        *CONFIG,
        "precision=params=float32,compute=bfloat16,matmul=fp8",
        "fp8.gather=true",
        "mesh.strategy=ddp",
    ],
    "precision field": ["train", *CONFIG, "precision=compute=bf16,speed=fast"],
    "precision matmul": ["train", *CONFIG, "precision=matmul=fp4"],
    "offload nvme bias": [
        "train",
        *CONFIG,
        "model.n_experts=4",
        "model.experts_per_token=2",
        "model.moe_ffn_dim=64",
        "model.bias_update_speed=0.001",
        "offload=optimizer:nvme",
    ],
    "profile end": ["train", *CONFIG, "train.profile=2:999999"],
    "process_id": ["train", *CONFIG, "distributed.process_id=3", "distributed.num_processes=2"],
}


def _tables():
    """The tests' tables, read without tests/helpers.py (which imports JAX)."""
    sys.path.insert(0, str(ROOT / "tests"))
    sys.modules["helpers"] = types.SimpleNamespace(call=None, one_line=None, script=None)
    import test_cli
    import test_hostile_flags

    return test_hostile_flags, test_cli


def _cases(all_values: bool, tmp: Path):
    hf, tc = _tables()
    for d in ("a_dir", "new", "run", "src"):
        (tmp / d).mkdir()
    (tmp / "a_file").write_text("x")
    (tmp / "run" / "metrics.jsonl").write_text('{"step": 1, "loss": 2.0}\n')
    (tmp / "src" / "a.txt").write_text("some text to tokenize\n" * 50)
    from fsdp_jax.app.cli import entry

    for script, table in hf.BAD_FLAG_VALUES.items():
        for flag, values in table.items():
            if isinstance(values, str):
                continue
            for v in values if all_values else values[:1]:
                argv = hf.BASE_ARGS[script] + [flag, v] + hf.TAIL_ARGS.get(script, [])
                yield f"{script} {flag} {v}", [entry.SCRIPTS[script], *hf._fill(argv, tmp)]
    for name, argv in tc.REFUSED_CONFIGS.items():
        yield f"config {name}", [name, *argv]
    for table in (tc.REFUSED_FLAGS, tc.REFUSED_ACROSS, ACROSS):
        yield from table.items()


def _probe(argv: list[str]) -> tuple[int, bool, str]:
    """(exit code, JAX loaded, its stderr's non-empty lines) of `fsdp-jax ARGV` in a forked child."""
    r, w = os.pipe()
    err = tempfile.TemporaryFile(mode="w+")
    pid = os.fork()
    if pid == 0:  # the child: run the command, report, leave without cleanup
        os.close(r)
        os.dup2(err.fileno(), 2)
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
        from fsdp_jax.app.cli import entry

        try:
            rc = entry.main(argv)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except BaseException:
            rc = 99
        os.write(w, f"{rc} {int('jax' in sys.modules)}".encode())
        os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    with os.fdopen(r) as f:
        rc, jax = f.read().split()
    err.seek(0)
    lines = [line for line in err.read().splitlines() if line.strip()]
    return int(rc), jax == "1", "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--all", action="store_true", help="every bad value of each flag, not the first only")
    ap.add_argument("--jax-only", action="store_true", help="print only the refusals that loaded JAX")
    ap.add_argument("--across", action="store_true", help="only the ACROSS table")
    ap.add_argument("--save", default=None, help="write {case: [exit code, JAX loaded, stderr]} here as JSON")
    args = ap.parse_args()
    os.chdir(ROOT)
    with tempfile.TemporaryDirectory() as tmp:
        cases = list(ACROSS.items()) if args.across else list(_cases(args.all, Path(tmp)))
        assert "jax" not in sys.modules, "the parent must not load JAX (a fork would inherit it)"
        n_jax, saved = 0, {}
        for name, argv in cases:
            rc, jax, line = _probe(argv)
            n_jax += jax
            saved[name] = [rc, jax, line]
            if jax or not args.jax_only:
                print(f"{'JAX ' if jax else 'pure'} rc={rc} {name:40.40} {line[:110]}", flush=True)
    print(f"{n_jax} of {len(cases)} refusals loaded JAX")
    if args.save:
        Path(args.save).write_text(json.dumps(saved, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
