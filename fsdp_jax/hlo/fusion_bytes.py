"""Bytes a fusion (or a bare data op) reads and writes, from its fused computation.

    written = fusion_bytes(rows, operands, operand_types, out_type)

`rows` are the fused computation's instructions (`fsdp_jax.hlo.schedule.parse_instructions`),
`operands` / `operand_types` the fusion's own operands (names and types, in order): operand i
is the fused computation's `parameter(i)`. An op without a fused computation (rows empty)
reads every operand in full and writes its result.

Reads: a parameter counts what its users take from it, followed through element-preserving
views (`VIEWS`: bitcast, reshape, transpose, copy: inside a fusion they remap indices and move
nothing of their own) and through a dynamic-update-slice that passes the buffer on (what is
read of its result is at most what is read of the buffer): a slice (`SLICES`) takes its
result's bytes, the buffer of an in-place update takes nothing, any other use takes all of it.

Writes: each output (the root, or each element of a root tuple) writes its bytes, except an
in-place dynamic-update-slice, which writes its update. An output is updated in place as
XLA:GPU emits it (`CanEmitFusedDynamicUpdateSliceInPlaceForGpu`,
xla/service/gpu/ir_emission_utils.cc): every output is a dynamic-update-slice, seen through
bitcasts (`ROOT dus`, `ROOT bitcast(dus)`, `ROOT tuple(dus, ...)`, `ROOT tuple(bitcast(dus),
...)`), each used by nothing but that path to the root, whose buffer operand is a fusion
parameter, directly or through a bitcast. A KV-cache update (`ROOT dynamic-update-slice(
bitcast(param), new_token_keys, ...)`) thus moves the token's keys, not the cache; an update
into a buffer the fusion builds (a broadcast) writes the whole result.
"""

from __future__ import annotations

import re

from fsdp_jax.hlo.types import DTYPE_BYTES, type_dims, type_shapes

VIEWS = frozenset(("bitcast", "reshape", "transpose", "copy"))
SLICES = frozenset(("dynamic-slice", "slice", "gather"))
_OPERANDS_RE = re.compile(r"%([\w.\-]+)")
_PARAM_RE = re.compile(r"parameter\((\d+)\)")


def nbytes(type_str: str) -> int:
    """Bytes of an HLO type (a tuple's: the sum of its elements')."""
    return sum(n * DTYPE_BYTES[dt] for dt, n in type_shapes(type_str))


def operand_names(line: str, op: str) -> list[str]:
    """The operand names of an instruction line (the text between `op(` and its `)`)."""
    start = line.find(f" {op}(") + len(op) + 2
    depth, end = 1, start
    while end < len(line) and depth:
        depth += {"(": 1, ")": -1}.get(line[end], 0)
        end += 1
    return _OPERANDS_RE.findall(line[start : end - 1])


class _Fused:
    """A fused computation's instructions by name, their operands and users, its outputs."""

    def __init__(self, rows):
        self.op = {name: op for _, name, op, _, _ in rows}
        self.type = {name: t for _, name, _, t, _ in rows}
        self.operands = {name: operand_names(line, op) for _, name, op, _, line in rows}
        self.users: dict[str, list[str]] = {name: [] for name in self.op}
        for name, ops in self.operands.items():
            for o in dict.fromkeys(ops):
                self.users.setdefault(o, []).append(name)
        self.params = {int(_PARAM_RE.search(line).group(1)): name for _, name, op, _, line in rows if op == "parameter"}
        root = next((name for _, name, _, _, line in rows if line.lstrip().startswith("ROOT")), None)
        self.outputs = self.operands[root] if root and self.op[root] == "tuple" else [root] if root else []
        self.in_place = self._in_place_updates()
        self._read: dict[str, int] = {}

    def _through_bitcasts(self, name: str) -> str:
        while self.op.get(name) == "bitcast":
            name = self.operands[name][0]
        return name

    def _in_place_updates(self) -> dict[str, str]:
        """{output: its dynamic-update-slice} when every output is updated in place, else {}."""
        found = {}
        for out in self.outputs:
            dus = self._through_bitcasts(out)
            if self.op.get(dus) != "dynamic-update-slice" or not self._only_path(dus, out):
                return {}
            buffer = self.operands[dus][0]
            if self.op.get(buffer) == "bitcast":
                buffer = self.operands[buffer][0]
            if self.op.get(buffer) != "parameter":
                return {}
            found[out] = dus
        updates = {tuple(type_dims(self.type[self.operands[d][1]])) for d in found.values()}
        return found if len(updates) == 1 else {}

    def _only_path(self, dus: str, out: str) -> bool:
        """Whether `dus` reaches the output `out` through bitcasts used by nothing else."""
        node = dus
        while node != out:
            if len(self.users[node]) != 1 or self.op[self.users[node][0]] != "bitcast":
                return False
            node = self.users[node][0]
        return all(self.op[u] == "tuple" for u in self.users[out]) and len(self.users[out]) <= 1

    def read(self, name: str) -> int:
        """Bytes of `name`'s result that the fusion reads (at most all of them)."""
        if name not in self._read:
            self._read[name] = self._read_uncached(name)
        return self._read[name]

    def _read_uncached(self, name: str) -> int:
        full = nbytes(self.type.get(name, ""))
        users = self.users.get(name, [])
        if not users or name in self.outputs and name not in self.in_place:
            return full  # an output, or unused (a collective fusion's carrier hands such buffers on)
        taken = 0
        for u in users:
            first = self.operands[u][:1] == [name]
            if self.op[u] in VIEWS:
                taken += self.read(u)
            elif self.op[u] in SLICES and first:
                taken += nbytes(self.type[u])
            elif self.op[u] == "dynamic-update-slice" and first and u in self.in_place.values():
                continue  # the buffer updated in place: neither read nor rewritten
            elif self.op[u] == "dynamic-update-slice" and first:
                taken += self.read(u)
            else:
                return full
            if taken >= full:
                return full
        return taken

    def written(self) -> int:
        dus = self.in_place
        return sum(
            nbytes(self.type[self.operands[dus[o]][1]]) if o in dus else nbytes(self.type[o]) for o in self.outputs
        )


def fusion_bytes(rows, operands: list[str], operand_types: list[str], out_type: str) -> int:
    """Bytes a fusion whose fused computation is `rows` (empty: a bare op) reads from its
    `operands` (their types `operand_types`) and writes into its result `out_type`."""
    if not rows:
        return sum(nbytes(t) for t in operand_types) + nbytes(out_type)
    fused = _Fused(rows)
    read = 0
    for i, t in enumerate(operand_types):
        pname = fused.params.get(i)
        read += fused.read(pname) if pname is not None else nbytes(t)
    return read + (fused.written() if fused.outputs else nbytes(out_type))
