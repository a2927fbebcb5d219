"""Seed tests/compiled/ with the suite's longest deviceless target compiles.

The suite keeps every XLA:TPU / XLA:GPU compile by its program in .jax_cache/compiled
(fsdp_jax.targets.compile_cache; tests/conftest.py). After a whole run of README's test command
on a clean checkout, this copies the entries whose compile took at least --min-s seconds here,
where a clean clone's suite reads them; `--replace` first removes the seeds of the same jax that
run did not produce (programs the code no longer lowers); another jax's seeds stay (CI's
Python 3.12 lane: run its GPU-target tests, then this again). A run writes only what it
compiled: `--replace` only after a run that read no seeds (`FSDP_JAX_COMPILED_CACHE` naming the
write folder alone), else it drops every seed that run found; after a seeded run, run this
without it to add the programs that missed. An entry is the compiler's own
output for a program, keyed by that program, the flags and the toolchain: a seed can only
answer for the exact program it was compiled from.

    python -m pytest -p no:cacheprovider && python tests/compiled/seed.py   # add what missed
"""

import argparse
import json
import lzma
import shutil
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]


def entry(path: Path) -> dict:
    return json.loads(lzma.decompress(path.read_bytes()))


def compile_seconds(path: Path) -> float:
    return float(entry(path)["compile_s"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="source", type=Path, default=ROOT / ".jax_cache" / "compiled")
    ap.add_argument("--min-s", type=float, default=10.0, help="keep compiles that took at least this long")
    ap.add_argument("--replace", action="store_true", help="drop seeds the source run did not produce")
    args = ap.parse_args(argv)
    entries = sorted(args.source.glob("*.json.xz"))
    if not entries:
        print(f"error: no compiled entries in {args.source} (run the suite first)", file=sys.stderr)
        return 2
    keep = {p.name: p for p in entries if compile_seconds(p) >= args.min_s}
    if args.replace:  # the seeds of the toolchains that run used (another jax's seeds stay)
        toolchains = {entry(p).get("toolchain") for p in entries}
        for old in HERE.glob("*.json.xz"):
            if old.name not in keep and entry(old).get("toolchain") in toolchains:
                old.unlink()
    for name, src in keep.items():
        shutil.copyfile(src, HERE / name)
    total = sum(compile_seconds(p) for p in keep.values())
    size = sum((HERE / n).stat().st_size for n in keep)
    print(f"{len(keep)} seeds of {len(entries)} entries, {total:.0f} s of compile, {size / 2**20:.1f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
