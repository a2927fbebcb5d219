"""What a compiled step holds at its most-live instant, from XLA's dump files: the bytes of the
temporaries live at each position of the schedule, counted as the union of the live values'
[offset, offset + size) in their allocations (aliased values once; a loop's carried tuple
elements, `while.N{i}`, included), so the maximum meets `memory_analysis()`'s temporaries.

    XLA_FLAGS="--xla_dump_to=DIR --xla_dump_hlo_as_text" python ...   # compile the step
    python benchmarks/hlo_live_bytes.py DIR [--module jit_step] [--at N] [--min-mb 0.2]

Prints the maximum and its position (the instruction and its op_name), then every value live
there of at least --min-mb, largest first: size, name{index}, shape, live range, op_name. Reads
`*<module>*-live-range.txt`, `*-buffer-assignment.txt` and `*after_optimizations.txt` (XLA:CPU's
and deviceless XLA:GPU's dumps alike). docs/planning.md "Item 7's jax 0.12.0.1 ring cases".
"""

from __future__ import annotations

import argparse
import glob
import re

VALUE = re.compile(r"\s*value: <\d+ ([\w.\-]+)(?:\{([\d,]*)\})?(?: \(phi\))? @\d+> \(size=(\d+),offset=(\d+)\): (\S+)")


def _one(folder: str, module: str, suffix: str) -> str:
    paths = sorted(p for p in glob.glob(f"{folder}/*{module}*{suffix}") if "before_optimizations" not in p)
    with open(paths[0]) as f:
        return f.read()


def read(folder: str, module: str = "jit_step"):
    """(values {(name, index): (allocation, temp, offset, size, shape)}, ranges [(name, index, start,
    end)], schedule {position: name}, op_names {name: op_name}) of the dumped module."""
    ops = dict(
        re.findall(
            r'^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name="([^"]*)"', _one(folder, module, "after_optimizations.txt"), re.M
        )
    )
    values, alloc, temp = {}, None, False
    for line in _one(folder, module, "-buffer-assignment.txt").splitlines():
        head = re.match(r"allocation (\d+): size \d+(.*)", line)
        if head:
            alloc, temp = int(head.group(1)), not any(w in head.group(2) for w in ("parameter", "constant"))
            continue
        m = VALUE.match(line)
        if m and alloc is not None:
            values[(m.group(1), m.group(2) or "")] = (alloc, temp, int(m.group(4)), int(m.group(3)), m.group(5))
    schedule_text, rest = _one(folder, module, "-live-range.txt").split("BufferLiveRange", 1)
    ranges = [
        (n, i, int(s), int(e))
        for n, i, s, e in re.findall(r"^\s+([\w.\-]+)\{([\d,]*)\}:(\d+)-(\d+)$", rest.split("Live ranges at")[0], re.M)
    ]
    schedule = {int(i): n for i, n in re.findall(r"^\s+(\d+):([\w.\-]+)$", schedule_text, re.M)}
    return values, ranges, schedule, ops


def live_at(values, ranges, t: int) -> tuple[int, list]:
    """(bytes of temporaries live at position t, the values live there)."""
    spans, live = {}, []
    for name, idx, start, end in ranges:
        v = values.get((name, idx))
        if v and v[1] and v[3] and start <= t <= end:
            spans.setdefault(v[0], []).append((v[2], v[2] + v[3]))
            live.append((v[3], name, idx, v[4], start, end))
    total = 0
    for xs in spans.values():
        hi = -1
        for lo, up in sorted(xs):
            total += max(0, up - max(lo, hi))
            hi = max(hi, up)
    return total, live


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("folder")
    ap.add_argument("--module", default="jit_step")
    ap.add_argument("--at", type=int, help="a schedule position (default: the maximum)")
    ap.add_argument("--min-mb", type=float, default=0.2)
    a = ap.parse_args()
    values, ranges, schedule, ops = read(a.folder, a.module)
    end = max(e for *_, e in ranges) + 1
    peak = max(range(end), key=lambda t: live_at(values, ranges, t)[0])
    at = peak if a.at is None else a.at
    total, live = live_at(values, ranges, at)
    best = live_at(values, ranges, peak)[0]
    print(f"most live: {best / 1e6:.2f} MB at {peak} {schedule.get(peak)} ({ops.get(schedule.get(peak, ''), '')})")
    print(f"at {at}: {total / 1e6:.2f} MB")
    for size, name, idx, shape, start, end_ in sorted(live, reverse=True):
        if size >= a.min_mb * 1e6:
            print(f"{size / 1e6:8.3f} {name}{{{idx}}} {shape} {start}-{end_} | {ops.get(name, '')}")


if __name__ == "__main__":
    main()
