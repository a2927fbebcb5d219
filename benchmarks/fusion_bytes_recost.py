"""Which ops of a compiled program the fusion-bytes rule of issue 58 costs differently from the
rule before it (docs/step_time.md, "Re-scored after the fusion-bytes fix").

    python benchmarks/fusion_bytes_recost.py ENTRY.json.xz [HLO.txt ...]

Each argument is a compile-cache entry (`fsdp_jax.targets.compile_cache`: .jax_cache/compiled,
tests/compiled) or an optimized HLO text (`XLA_FLAGS=--xla_dump_to=DIR`). The program's op
inventory is walked twice, with `fsdp_jax.hlo.fusion_bytes` (now) and with the rule it replaced
(below, as it was before commit 12f4acc: only a dynamic-update-slice at the fusion's root counted
as in place, and only a parameter used directly by slices counted as sliced); every op whose bytes
differ is printed with its runs per step, then the memory traffic per step under both walks and
how many of the program's fusions hold a dynamic-update-slice at all.
"""

from __future__ import annotations

import json
import lzma
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

_OPERANDS_RE = re.compile(r"%([\w.\-]+)")


def rule_before_issue_58(rows, operands: list[str], operand_types: list[str], out_type: str) -> int:
    """The fusion bytes as `hlo.costs` counted them before the fusion-bytes fix (its removed
    `_Module.fusion_bytes`, over the same arguments as `fsdp_jax.hlo.fusion_bytes.fusion_bytes`)."""
    from fsdp_jax.hlo.fusion_bytes import nbytes, operand_names

    params = {}
    for _, name, pop, _, pline in rows:
        if pop == "parameter":
            params[int(re.search(r"parameter\((\d+)\)", pline).group(1))] = name
    written = nbytes(out_type)
    root = next((r for r in rows if r[4].lstrip().startswith("ROOT")), None)
    in_place = root is not None and root[2] == "dynamic-update-slice"
    if in_place:
        upd = operand_names(root[4], root[2])
        if len(upd) > 1:
            written = nbytes(next((t for _, n, _, t, _ in rows if n == upd[1]), ""))
    read = 0
    for i, full_type in enumerate(operand_types[: len(operands)]):
        full = nbytes(full_type)
        pname = params.get(i)
        if pname is None:
            read += full
            continue
        users = [r for r in rows if pname in _OPERANDS_RE.findall(r[4].split("=", 1)[1])]
        if in_place and users == [root] and operand_names(root[4], root[2])[:1] == [pname]:
            continue  # the buffer updated in place: neither read nor rewritten
        if users and all(u[2] in ("dynamic-slice", "slice", "gather") for u in users):
            read += min(full, sum(nbytes(u[3]) for u in users))
        else:
            read += full
    return read + written


def hlo_text(path: Path) -> str:
    if path.name.endswith(".json.xz"):
        return json.loads(lzma.decompress(path.read_bytes()))["text"]
    return path.read_text()


def compare(text: str) -> dict:
    """The ops whose bytes the two rules count differently, and the traffic per step under each."""
    from fsdp_jax.hlo import costs

    now = costs.op_inventory(text)
    current = costs.fusion_bytes
    costs.fusion_bytes = rule_before_issue_58
    try:
        before = costs.op_inventory(text)
    finally:
        costs.fusion_bytes = current
    changed = [
        {"name": a["name"], "kind": a["kind"], "runs": a["runs"], "before": b["bytes"], "now": a["bytes"]}
        for a, b in zip(now, before)
        if a.get("bytes") != b.get("bytes")
    ]
    per_step = lambda inv: sum(o.get("bytes", 0) * o["runs"] for o in inv if o["kind"] == "memory")  # noqa: E731
    dus = len(re.findall(r"^\s*(?:ROOT )?%?[\w.\-]+ = [^\n]*\bdynamic-update-slice\(", text, re.M))
    return {
        "ops": len(now),
        "changed": changed,
        "memory_before": per_step(before),
        "memory_now": per_step(now),
        "dus": dus,
    }


def main(argv=None) -> int:
    paths = [Path(a) for a in (sys.argv[1:] if argv is None else argv)]
    if not paths:
        print("error: name a compile-cache entry (.json.xz) or an HLO text file", file=sys.stderr)
        return 2
    for path in paths:
        if not path.is_file():
            print(f"error: {path}: no such file", file=sys.stderr)
            return 2
        r = compare(hlo_text(path))
        print(
            f"{path.name}: {r['ops']} ops, {len(r['changed'])} costed differently; memory traffic per step "
            f"{r['memory_before'] / 1e9:.2f} GB before, {r['memory_now'] / 1e9:.2f} GB now; "
            f"{r['dus']} dynamic-update-slice instructions in the program"
        )
        for c in r["changed"]:
            print(f"    {c['name']} ({c['kind']}, x{c['runs']}): {c['before']:,} -> {c['now']:,} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
