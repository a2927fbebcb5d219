"""The call structure of a compiled HLO module's text: its computations, who calls
whom and how often (while-loop trip counts), and the loop each computation runs in.
`fsdp_jax.hlo.schedule` builds its collective schedule on these (and re-exports them)."""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any

_COMP_RE = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*(?:\([^)]*\)|\(.*\))\s*->.*\{\s*$")
_CALLS_RE = re.compile(
    r"\b(body|condition|calls|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
    r"|\b(?:branch_computations|called_computations)=\{([^}]*)\}"
)
_TRIP_RE = re.compile(r'"known_trip_count"\s*:\s*\{\s*"n"\s*:\s*"?(\d+)"?')
OP_NAME_RE = re.compile(r'op_name="([^"]*)"')


def parse_computations(hlo: str) -> tuple[dict[str, list[str]], str | None]:
    """({computation name: its instruction lines, in schedule order}, the ENTRY's name). An
    instruction whose text spans several lines comes as one line."""
    comps: dict[str, list[str]] = {}
    current, entry = None, None
    for line in hlo.splitlines():
        m = _COMP_RE.match(line.strip()) if line and not line.startswith(" ") else None
        if m:
            current = m.group(2)
            comps[current] = []
            if m.group(1):
                entry = current
        elif current is not None:
            if line.strip() == "}":
                current = None
            elif comps[current] and not line.startswith(" "):
                # an instruction written over several lines (a Mosaic TPU kernel's metadata):
                # one line, so its op_name and attributes stay with it
                comps[current][-1] += " " + line
            else:
                comps[current].append(line)
    return comps, entry


_CONST_RE = re.compile(r"^\s*%?([\w.\-]+)\s*=\s*s32\[\]\S*\s+constant\((\d+)\)")
_LT_RE = re.compile(
    r"^\s*ROOT\s+%?[\w.\-]+\s*=\s*pred\[\]\S*\s+compare\(%?[\w.\-]+,\s*%?([\w.\-]+)\),"
    r"\s*direction=LT"
)


def _counted_trips(cond: list[str]) -> int | None:
    """The trip count of a while loop whose condition is `i < N` with a constant N (a scan
    counts i from 0 by 1): XLA:TPU's scheduled HLO carries no `known_trip_count`."""
    consts = {m.group(1): int(m.group(2)) for m in map(_CONST_RE.match, cond) if m}
    for line in cond:
        m = _LT_RE.match(line)
        if m and m.group(1) in consts:
            return consts[m.group(1)]
    return None


def call_graph(comps: dict[str, list[str]]):
    """Edges caller -> [(callee, runs per caller run)], plus the while loops found:
    a while body runs its known trip count per run of its caller (XLA:GPU's
    `known_trip_count`, else a condition `i < constant`; 1 if unknown)."""
    edges: dict[str, list[tuple[str, int]]] = defaultdict(list)
    loops: list[dict[str, Any]] = []
    for name, lines in comps.items():
        for line in lines:
            is_while = " while(" in line
            trip = None
            if is_while:
                m = _TRIP_RE.search(line)
                cond = re.search(r"\bcondition=%?([\w.\-]+)", line)
                trip = int(m.group(1)) if m else (_counted_trips(comps.get(cond.group(1), [])) if cond else None)
            for m in _CALLS_RE.finditer(line):
                names = [m.group(2)] if m.group(2) else [n.strip().lstrip("%") for n in m.group(3).split(",")]
                for callee in names:
                    if is_while and m.group(1) == "body":
                        edges[name].append((callee, trip or 1))
                        op = OP_NAME_RE.search(line)
                        loops.append(
                            {"body": callee, "parent": name, "trip_count": trip, "op_name": op.group(1) if op else ""}
                        )
                    elif is_while and m.group(1) == "condition":
                        edges[name].append((callee, (trip or 1) + 1))
                    else:
                        edges[name].append((callee, 1))
    return edges, loops


def executions(comps, edges, entry: str | None) -> dict[str, int]:
    """How many times each computation runs per call of the entry computation."""
    roots = (
        [entry]
        if entry in comps
        else [c for c in comps if not any(c == callee for es in edges.values() for callee, _ in es)]
    )
    order: list[str] = []
    seen: set[str] = set()
    for r in roots:  # post-order DFS; HLO call graphs are acyclic
        if r in seen:
            continue
        seen.add(r)
        stack = [(r, iter(edges.get(r, ())))]
        while stack:
            node, it = stack[-1]
            nxt = next(it, None)
            if nxt is None:
                order.append(node)
                stack.pop()
            elif nxt[0] not in seen:
                seen.add(nxt[0])
                stack.append((nxt[0], iter(edges.get(nxt[0], ()))))
    runs: dict[str, int] = defaultdict(int)
    for r in roots:
        runs[r] = 1
    for c in reversed(order):  # callers before callees
        for callee, k in edges.get(c, ()):
            runs[callee] += runs[c] * k
    return dict(runs)


def enclosing_loops(comps, edges, loops) -> dict[str, dict[str, Any]]:
    """Computation name -> the innermost while loop (a `loops` entry) it runs inside:
    of all loop bodies that reach it, the one reaching the fewest computations (a nested
    loop's reach is part of its outer loop's)."""
    reach = [(_reach(edges, lp["body"]), lp) for lp in loops]
    out: dict[str, dict[str, Any]] = {}
    for c in comps:
        inside = [(len(r), lp) for r, lp in reach if c in r]
        if inside:
            out[c] = min(inside, key=lambda x: x[0])[1]
    return out


def _reach(edges, start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        c = stack.pop()
        if c in seen:
            continue
        seen.add(c)
        stack.extend(callee for callee, _ in edges.get(c, ()))
    return seen
