"""What each op of a compiled program does, in target-free units: FLOPs, bytes, messages.

    ops = op_inventory(compiled.as_text(), hosts=[d.process_index for d in mesh.devices.flat])
    for o in ops: print(o["kind"], o["computation"], o["pos"], o["runs"], o.get("flops"), o.get("bytes"))

One record per instruction that runs as a kernel (or a transfer) in a computation executed
in sequence (the entry, while bodies and conditions, conditional branches, `call`s); the
instructions of fused computations are read only to describe their fusion. Each record:
`kind`, `name`, `computation`, `pos` (its index in the computation's schedule), `runs`
(executions per step: while-loop trip counts multiplied in), `op_name`, and by kind:

- `gemm`: a dot (a cuBLAS custom call, a Triton/XLA GEMM fusion, a convolution fusion on TPU,
  a bare dot): `m`, `n`, `k`, `batch`, `dtype` (the lhs operand's), `flops` = 2 batch m n k,
  `bytes` (operands + result); a ragged dot's grouped-GEMM kernel (tokamax's Triton / Mosaic
  GPU / Mosaic TPU calls, XLA:TPU's own, `fsdp_jax.hlo.grouped`; also inside the dynamic-slice
  fusion XLA:GPU wraps one in) adds `groups`, its `flops` those of the grouped rows;
- `attention`: a cuDNN flash-attention custom call: `direction` (fwd / bwd), `b`, `h`, `sq`,
  `skv`, `d`, `causal`, `flops` (4 b h sq skv d forward, 2.5x that backward, halved when causal:
  FlashAttention's count); or a Pallas splash-attention kernel on TPU (`kernel` "splash",
  `part` fwd / dq / dkv: 2, 3 and 4 matmuls of 2 b h sq skv d FLOPs, halved when causal: a
  square call, as `fsdp_jax.attention.splash` and a ring's own block build it; the flash
  ring's half blocks, sq != skv, are unmasked);
- `memory`: any other fusion or data op: `bytes` read + written (a fused parameter read only
  through slices counts the slices; an in-place dynamic-update-slice output, also through
  bitcasts or in a root tuple, counts the update, not the whole buffer:
  `fsdp_jax.hlo.fusion_bytes`);
- `collective`: a collective (async start, or synchronous): the fields of
  `fsdp_jax.hlo.schedule.collective_schedule` (`op`, `bytes`, `group_size`, `crosses_hosts`,
  `async`, ...) plus `done_pos`, the position of its done (None when not in this computation);
- `host`: a copy to or from host memory (`copy-start` into memory space S(5) or out of it,
  or XLA:TPU's async dynamic-update-slice into / dynamic-slice out of a host buffer, as
  `remat=offload_*` compiles there): `bytes` (the slice moved), `done_pos`;
- `loop`: a while loop (`body`, `condition`, `trip_count`): its cost is its body's;
- `conditional`: a conditional (`branches`, its branch computations): one of them runs.

Nothing here knows a target: `fsdp_jax.app.planner.op_costs` turns these into seconds.
"""

from __future__ import annotations

import math
import re
from typing import Any

from fsdp_jax.hlo.calls import OP_NAME_RE, call_graph, executions, parse_computations
from fsdp_jax.hlo.collective_fusions import fused_collectives, fusion_roles
from fsdp_jax.hlo.conv_gemm import conv_dims
from fsdp_jax.hlo.fusion_bytes import fusion_bytes, nbytes, operand_names
from fsdp_jax.hlo.grouped import grouped_gemm
from fsdp_jax.hlo.schedule import COLLECTIVES, collective_schedule, parse_instructions
from fsdp_jax.hlo.types import DTYPE_BYTES, type_dims, type_shapes

FREE_OPS = frozenset(
    "parameter constant get-tuple-element tuple bitcast after-all partition-id replica-id "
    "opt-barrier add-dependency iota conditional call copy-done send-done recv-done send recv "
    "domain get-dimension-size".split()
)
_OPERANDS_RE = re.compile(r"%([\w.\-]+)")
_DIMS_RE = {k: re.compile(rf"\b{k}=\{{([\d,]*)\}}") for k in ("lhs_contracting_dims", "lhs_batch_dims")}
_JSON_DIMS_RE = {
    "lhs_contracting_dims": re.compile(r'"lhs_contracting_dimensions":\[([^\]]*)\]'),
    "lhs_batch_dims": re.compile(r'"lhs_batch_dimensions":\[([^\]]*)\]'),
}
_CALLS_RE = re.compile(r"\bcalls=%?([\w.\-]+)")
_TARGET_RE = re.compile(r'custom_call_target="([^"]+)"')
_SPLASH_RE = re.compile(r"^\s*(?:ROOT\s+)?%?splash_\w*?_(fwd|dq|dkv)[_.]")
_LAYOUTS_RE = re.compile(r"operand_layout_constraints=\{(.*)")
_FLOAT_ARRAY_RE = re.compile(r"\b(?:bf16|f16|f32)\[([\d,]+)\]")
SPLASH_MATMULS = {"fwd": 2, "dq": 3, "dkv": 4}  # fwd: q k^T, p v; dq: + do v^T, ds k; dkv: + p^T do, ds^T q
_INTERMEDIATE_RE = re.compile(r'"intermediate_tensor_shape":\{"element_type":"\w+","dimensions":\[([^\]]*)\]')


def _index_list(text: str | None) -> list[int]:
    return [int(x.strip().strip('"')) for x in text.split(",") if x.strip()] if text else []


def _gemm_dims(line: str, lhs: str, out: str, json_dims: bool = False, rhs: str = "") -> dict[str, Any]:
    """m, n, k, batch, flops of a dot whose lhs type is `lhs` and result type `out` (a
    convolution: from its dim_labels and the kernel type `rhs`)."""
    if " convolution(" in line and (conv := conv_dims(line, lhs, rhs, out)):
        return conv
    regs = _JSON_DIMS_RE if json_dims else _DIMS_RE
    got = {k: r.search(line.replace(" ", "") if json_dims else line) for k, r in regs.items()}
    contracting = _index_list(got["lhs_contracting_dims"].group(1) if got["lhs_contracting_dims"] else None)
    batch_dims = _index_list(got["lhs_batch_dims"].group(1) if got["lhs_batch_dims"] else None)
    ld, od = type_dims(lhs), type_dims(out)
    k = math.prod(ld[i] for i in contracting if i < len(ld)) or 1
    batch = math.prod(ld[i] for i in batch_dims if i < len(ld)) or 1
    m = max(math.prod(ld) // (k * batch), 1)
    n = max(math.prod(od) // (m * batch), 1)
    dtype = type_shapes(lhs)[0][0] if type_shapes(lhs) else "?"
    return {"m": m, "n": n, "k": k, "batch": batch, "dtype": dtype, "flops": 2 * batch * m * n * k}


class _Module:
    """The parsed module: computations, every instruction's result type, and each fused
    computation's parameters and instructions."""

    def __init__(self, hlo: str):
        self.comps, self.entry = parse_computations(hlo)
        self.parsed = {c: parse_instructions(lines) for c, lines in self.comps.items()}
        self.types = {name: t for rows in self.parsed.values() for _, name, _, t, _ in rows}

    def fused_dot(self, comp: str) -> tuple[str, str, str] | None:
        """(the dot or convolution line, its lhs and rhs types) inside a fused computation, or None."""
        for _, _, op, _, line in self.parsed.get(comp, ()):
            if op in ("dot", "convolution"):
                names = operand_names(line, op) + ["", ""]
                return line, self.types.get(names[0], ""), self.types.get(names[1], "")
        for _, _, op, _, line in self.parsed.get(comp, ()):  # a nested GEMM fusion
            m = _CALLS_RE.search(line)
            if op == "fusion" and m and (inner := self.fused_dot(m.group(1))):
                return inner
        return None

    def fused_custom_call(self, comp: str) -> tuple[str, str] | None:
        """(the custom-call line, its result type) inside a fused computation, or None."""
        for _, _, op, type_str, line in self.parsed.get(comp, ()):
            if op == "custom-call":
                return line, type_str
        return None

    def fusion_bytes(self, line: str, op: str, out_type: str, comp: str | None) -> int:
        """Bytes a fusion (or data op) reads and writes (`fsdp_jax.hlo.fusion_bytes`)."""
        operands = operand_names(line, op)
        rows = self.parsed.get(comp, []) if comp else []
        return fusion_bytes(rows, operands, [self.types.get(n, "") for n in operands], out_type)


_SEQ_CALLEES_RE = re.compile(
    r"\b(?:body|to_apply|true_computation|false_computation)=%?([\w.\-]+)"
    r"|\bbranch_computations=\{([^}]*)\}"
)
_HOST_SPACE_RE = re.compile(r"\{[^{}]*S\(5\)\}")
_ASYNC_SLICES = frozenset(("async-start", "dynamic-update-slice-start", "dynamic-slice-start"))
_ARRAY_LAYOUT_RE = re.compile(r"\b(\w+)\[([\d,]*)\](\{[^{}]*\})?")


def host_slice_bytes(type_str: str) -> int:
    """The bytes an async dynamic-(update-)slice moves between host memory (S(5)) and the
    device: the largest array of its type not in host memory (the update written into the
    host buffer, or the slice read out of it); the host buffer itself is not moved."""
    sizes = [
        math.prod(int(d) for d in dims.split(",") if d) * DTYPE_BYTES.get(dt, 0)
        for dt, dims, layout in _ARRAY_LAYOUT_RE.findall(type_str)
        if dt in DTYPE_BYTES and not _HOST_SPACE_RE.search(layout or "")
    ]
    return max(sizes, default=0)


def _sequential(mod: _Module) -> list[str]:
    """The computations whose instructions run one after another as kernels: the entry and
    what its while loops, conditionals and calls run (not fused bodies, reducers, nor
    async wrappers: an `async-start` of a collective is that collective, started there)."""
    out, stack = [], [mod.entry] if mod.entry else list(mod.comps)[:1]
    while stack:
        c = stack.pop()
        if c in out or c not in mod.comps:
            continue
        out.append(c)
        for _, _, op, _, line in mod.parsed[c]:
            if op in ("while", "conditional", "call"):
                for m in _SEQ_CALLEES_RE.finditer(line):
                    names = [m.group(1)] if m.group(1) else [n.strip().lstrip("%") for n in m.group(2).split(",")]
                    stack.extend(names)
    return out


def _attention(line: str, out_type: str) -> dict[str, Any] | None:
    """The shape and FLOPs of a cuDNN flash-attention custom call (None if not one)."""
    target = _TARGET_RE.search(line)
    if not target or "fmha" not in target.group(1):
        return None
    backward = "Backward" in target.group(1)
    inter = _INTERMEDIATE_RE.search(line.replace(" ", ""))
    if not inter:  # no shape: costing it at (1, 1, 1, 1) would drop the kernel silently
        raise ValueError(f"a cuDNN attention call with no intermediate_tensor_shape: {line.strip()[:200]}")
    b, h, sq, skv = _index_list(inter.group(1))
    first = type_shapes(out_type)[0][1] if type_shapes(out_type) else 0
    d = max(first // max(b * h * sq, 1), 1)
    causal = '"mask_type":"CAUSAL"' in line.replace(" ", "")
    flops = 4 * b * h * sq * skv * d * (2.5 if backward else 1.0) * (0.5 if causal else 1.0)
    return {
        "direction": "bwd" if backward else "fwd",
        "b": b,
        "h": h,
        "sq": sq,
        "skv": skv,
        "d": d,
        "causal": causal,
        "flops": flops,
    }


def _splash(line: str) -> dict[str, Any] | None:
    """The shape and FLOPs of a splash-attention kernel call (None if not one): q and k are its
    first two float operands of 4+ dims in `operand_layout_constraints`, (b, heads..., s, d).
    The kernel's name does not say its mask: square calls are causal (`app/models/splash.py`, a
    ring's own block), the others the flash ring's unmasked half blocks (`sharding/ring_splash`)."""
    part = _SPLASH_RE.match(line)
    layouts = _LAYOUTS_RE.search(line)
    arrays = [_index_list(m) for m in _FLOAT_ARRAY_RE.findall(layouts.group(1))] if layouts else []
    q, k = ([a for a in arrays if len(a) >= 4] + [[], []])[:2]
    if not part or not q or not k:
        return None
    b, h, sq, d, skv = q[0], math.prod(q[1:-2]), q[-2], q[-1], k[-2]
    part = part.group(1)
    return {
        "kernel": "splash",
        "part": part,
        "direction": "fwd" if part == "fwd" else "bwd",
        "b": b,
        "h": h,
        "sq": sq,
        "skv": skv,
        "d": d,
        "causal": sq == skv,
        "flops": SPLASH_MATMULS[part] * 2 * b * h * sq * skv * d * (0.5 if sq == skv else 1.0),
    }


def _classify(mod: _Module, op: str, type_str: str, line: str) -> dict[str, Any] | None:
    """A record's kind and cost fields for one instruction (None: free, or a collective)."""
    if op in FREE_OPS or op.endswith("-done") or op in COLLECTIVES or op.removesuffix("-start") in COLLECTIVES:
        return None
    if op == "copy-start":
        host = bool(_HOST_SPACE_RE.search(type_str)) or bool(
            _HOST_SPACE_RE.search(mod.types.get((operand_names(line, op) or [""])[0], ""))
        )
        return {"kind": "host" if host else "memory", "bytes": nbytes(_shapes_first(type_str))}
    if op in _ASYNC_SLICES and _HOST_SPACE_RE.search(type_str):
        # XLA:TPU's activation offload: a layer's residual written into (read out of) a
        # stacked host buffer by an async dynamic-update-slice (dynamic-slice) over PCIe;
        # `compiled.as_text()` prints the wrapper in its short form, a dump as async-start
        return {"kind": "host", "bytes": host_slice_bytes(type_str)}
    if op == "fusion-start":
        # XLA:GPU from jax 0.12 runs fusions asynchronously too (`fusion-start` / `fusion-done`:
        # the layer loops' dynamic-slice and dynamic-update-slice fusions of stacked buffers); the
        # start's type is ((operands), result, context): its cost is the fusion's, as jax 0.10.2's
        # XLA:GPU ran it inline (counting the tuple's operands, the whole stack, put ~2.4 s of HBM
        # traffic on the 7B step of PUBLISHED_RUNS[0])
        op, type_str, line = "fusion", _async_result(type_str), line.replace(" fusion-start(", " fusion(", 1)
    if op == "custom-call":
        att = _attention(line, type_str) or _splash(line)
        if att:
            return {"kind": "attention", **att}
        if grp := grouped_gemm(line, type_str):
            return {"kind": "gemm", **grp}
        target = _TARGET_RE.search(line)
        if target and ("gemm" in target.group(1) or "matmul" in target.group(1)):
            names = operand_names(line, op)
            out = _shapes_first(type_str)
            g = _gemm_dims(line, mod.types.get(names[0], "") if names else "", out, json_dims=True)
            return {"kind": "gemm", **g, "bytes": sum(nbytes(mod.types.get(n, "")) for n in names[:2]) + nbytes(out)}
    if op in ("dot", "convolution"):
        names = operand_names(line, op)
        names = names + ["", ""]
        g = _gemm_dims(line, mod.types.get(names[0], ""), type_str, rhs=mod.types.get(names[1], ""))
        return {"kind": "gemm", **g, "bytes": mod.fusion_bytes(line, op, type_str, None)}
    called = _CALLS_RE.search(line)
    comp = called.group(1) if called else None
    if op == "fusion" and comp and (inner := mod.fused_custom_call(comp)):
        # a kernel call XLA:GPU (jax 0.12) wraps in a dynamic-slice fusion to read one layer's
        # slice of stacked weights in place: the fusion's op_name names the ragged dot
        if grp := grouped_gemm(inner[0] + " " + line, inner[1]):
            return {"kind": "gemm", **grp}
        # jax 0.12's XLA:GPU: a cuBLASLt matmul in a kCustom dynamic-slice fusion, reading one layer's
        # slice of a kept stack in place; its result tuple holds a 32 MiB workspace, not traffic
        target = _TARGET_RE.search(inner[0])
        if target and ("gemm" in target.group(1) or "matmul" in target.group(1)):
            return _classify(mod, "custom-call", inner[1], inner[0])
    if op == "fusion" and comp and (dot := mod.fused_dot(comp)):
        out = re.match(r"\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.*?)\s(?:dot|convolution)\(", dot[0]).group(1)
        g = _gemm_dims(dot[0], dot[1], _shapes_first(out), rhs=dot[2])
        return {"kind": "gemm", **g, "bytes": mod.fusion_bytes(line, op, type_str, comp)}
    return {"kind": "memory", "bytes": mod.fusion_bytes(line, op, type_str, comp if op == "fusion" else None)}


def _async_result(type_str: str) -> str:
    """The result of an async start's type `((operands...), result, context)`: its second
    top-level element (the whole type if it is not such a tuple)."""
    inner, parts, depth, start = type_str.strip()[1:-1], [], 0, 0
    for i, ch in enumerate(inner):
        depth += {"(": 1, "{": 1, "[": 1, ")": -1, "}": -1, "]": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(inner[start:i].strip())
            start = i + 1
    parts.append(inner[start:].strip())
    return parts[1] if type_str.strip().startswith("((") and len(parts) >= 2 else type_str


def _shapes_first(type_str: str) -> str:
    """The first array type of a (possibly tuple) type string."""
    m = re.search(r"\b\w+\[[\d,]*\]", type_str)
    return m.group(0) if m else type_str


def op_inventory(hlo: str, hosts: list[int] | None = None) -> list[dict[str, Any]]:
    """One record per op that costs time (see the module docstring), in schedule order per
    computation. `hosts`: the host of each device id (collectives crossing hosts)."""
    mod = _Module(hlo)
    edges, _ = call_graph(mod.comps)
    runs = executions(mod.comps, edges, mod.entry)
    colls = {(c["computation"], c["name"]): c for c in collective_schedule(hlo, hosts)}
    fused = fused_collectives(mod.parsed)
    out: list[dict[str, Any]] = []
    for cname in _sequential(mod):
        rows = mod.parsed[cname]
        position = {name: k for k, (_, name, _, _, _) in enumerate(rows)}
        roles = fusion_roles(rows, fused)
        for k, (_, name, op, type_str, line) in enumerate(rows):
            base = {"name": name, "computation": cname, "pos": k, "runs": runs.get(cname, 1)}
            om = OP_NAME_RE.search(line)
            base["op_name"] = om.group(1) if om else ""
            role = roles.get(k, ("",))
            wrapped = _CALLS_RE.search(line) if op == "async-start" else None
            inner = [c for (cc, _), c in colls.items() if wrapped and cc == wrapped.group(1)]
            if role[0] == "start":  # a TPU collective fusion (fsdp_jax.hlo.collective_fusions)
                inner = [{**c, "async": role[1] is not None} for (cc, _), c in colls.items() if cc in role[2]]
            if role[0] == "done":  # the collective's end: its time is the start's record
                continue
            if (cname, name) in colls or inner:
                c = {**(inner[0] if inner else colls[(cname, name)]), **({"async": True} if wrapped else {})}
                keep = ("op", "bytes", "dtype", "group_size", "crosses_hosts", "async", "phase", "loop")
                done = role[1] if role[0] == "start" else _done(rows, k, name, position)
                out.append({**base, "kind": "collective", **{f: c[f] for f in keep}, "done_pos": done})
                continue
            if op == "while":
                body = re.search(r"\bbody=%?([\w.\-]+)", line)
                edges_from = dict(edges.get(cname, ()))
                out.append(
                    {
                        **base,
                        "kind": "loop",
                        "body": body.group(1) if body else None,
                        "trip_count": edges_from.get(body.group(1), 1) if body else 1,
                    }
                )
                continue
            if op == "conditional":  # its cost is one branch's (op_costs.simulate: the longest)
                m = _SEQ_CALLEES_RE.findall(line)
                names = [a or n.strip().lstrip("%") for a, b in m for n in ([a] if a else b.split(","))]
                out.append({**base, "kind": "conditional", "branches": names})
                continue
            rec = _classify(mod, op, type_str, line)
            if rec is None:
                continue
            if role[0] == "carrier":  # its own work: less the collective's buffers it hands on
                rec["bytes"] = max(rec["bytes"] - 2 * role[1], 0)
            if rec["kind"] == "host":
                rec["done_pos"] = _done(rows, k, name, position)
            out.append({**base, **rec})
    return out


def _done(rows, k: int, name: str, position: dict[str, int]) -> int | None:
    """The position of the `*-done` that consumes async start `name`, if in this computation."""
    pat = re.compile(rf"\(%?{re.escape(name)}[),]")
    for _, dname, op, _, line in rows[k + 1 :]:
        if op.endswith("-done") and pat.search(line):
            return position[dname]
    return None
