"""What a deviceless compile tells the planner, kept by the program it was compiled from.

A deviceless XLA:TPU or XLA:GPU compile of a large step takes minutes on a laptop's cores, and
the planner reads three things from it: the optimized HLO text, `memory_analysis()` and (on
TPU) the input layouts; tests read `cost_analysis()` too. `compile_lowered(lowered, devices)`
returns a `CompiledFacts` that answers those as the compile did, from the compile or, when the
same program was compiled before, from the cache:

    compiled = compile_lowered(step.lower(state, batch), mesh.devices.flat)
    compiled.as_text(); compiled.memory_analysis(); compiled.input_formats; compiled.cost_analysis()

The key is the lowered program's text (StableHLO without source locations), the compiler
options, the XLA / libtpu flags in the environment (less those naming a file or folder to
write), the jax and jaxlib versions, the target backend's platform version, and every device's
id, kind and coordinates: a change to the model, the sharding, the flags, the toolchain or the
topology is a different program and compiles afresh. A `jax.experimental.custom_partitioning`
call (cuDNN attention's, the ring's) names its Python partitioner by the object's address in
this process (`@CustomSPMDPartitioning` ... `backend_config = "140320513637968"`): the key
reads it as the call's position instead, or no such program would ever be found again; a Pallas
kernel's serialized MLIR (splash attention, tokamax's grouped matmul) carries where it was traced
(this clone's folder, the source line): the key reads the kernel without its locations. A program the compiler refused for memory
(RESOURCE_EXHAUSTED) is kept too: the kept refusal raises `CompileRefused` with the compiler's
message. Nothing is cached for programs that could run here (CPU devices): those are executed,
and compile in seconds. A compile asked to dump (`xla_dump_to`) always compiles.

Where: `$FSDP_JAX_COMPILED_CACHE`, a `os.pathsep`-separated list of folders; new entries are
written to the first, every folder is read (a read-only seed folder can follow a writable
one). Unset, nothing is cached. An entry is one xz-compressed JSON file named by its key,
written atomically; an unreadable entry is a miss. The suite reads the seed folder
`tests/compiled/` (scripts/seed_compiled.py writes it).
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import json
import lzma
import os
import re
import time
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import jax
import jaxlib
from jax._src.interpreters import mlir
from jax._src.lib import tpu
from jaxlib.mlir import ir

from fsdp_jax.errors import CompileRefused

ENV = "FSDP_JAX_COMPILED_CACHE"
_REFUSAL = "RESOURCE_EXHAUSTED"
TOOLCHAIN = f"jax {jax.__version__} jaxlib {jaxlib.__version__}"  # in the key, and stored beside the entry
FORMAT = 1
_FLAG_ENVS = ("XLA_FLAGS", "LIBTPU_INIT_ARGS")
_CHECKOUT = str(Path(__file__).resolve().parents[2]) + "/"
_PACKAGES = re.compile(r"/[^\s\"\\\x00]*/(?:site|dist)-packages/")
_STACK_TABLES = frozenset({"FileNames", "FunctionNames", "FileLocations", "StackFrames"})
_PATH_FLAG_ENDINGS = ("_file", "_dir", "_to", "_path")
_WORK_FLAGS = frozenset({"--xla_cpu_parallel_codegen_split_count"})  # how many LLVM modules, not what they hold
_MEMORY_FIELDS = (
    "argument_size_in_bytes",
    "output_size_in_bytes",
    "alias_size_in_bytes",
    "temp_size_in_bytes",
    "generated_code_size_in_bytes",
    "host_argument_size_in_bytes",
    "host_output_size_in_bytes",
    "host_alias_size_in_bytes",
    "host_temp_size_in_bytes",
    "host_generated_code_size_in_bytes",
    "peak_memory_in_bytes",
)


@dataclasses.dataclass(frozen=True)
class TileLayout:
    """An input's layout as `fsdp_jax.targets.tpu.tiled_bytes` reads it."""

    major_to_minor: tuple[int, ...]
    tiling: tuple[tuple[int, ...], ...]


@dataclasses.dataclass(frozen=True)
class InputFormat:
    layout: TileLayout


@dataclasses.dataclass(frozen=True)
class CompiledFacts:
    """A cached compile: the optimized HLO text, `memory_analysis()`'s fields, the input
    layouts (or the error reading them raised), and how long the compile took."""

    key: str
    text: str
    memory: dict[str, int]
    layouts: list[dict[str, Any]] | None
    layouts_error: str | None
    compile_s: float
    refused: str | None = None  # the compiler's message where it refused the program
    cost: dict[str, float] | None = None  # cost_analysis()

    def cost_analysis(self) -> dict[str, float]:
        return dict(self.cost or {})

    def as_text(self) -> str:
        return self.text

    def memory_analysis(self) -> SimpleNamespace:
        return SimpleNamespace(**self.memory)

    @property
    def input_formats(self) -> list[InputFormat]:
        if self.layouts is None:
            raise ValueError(self.layouts_error or "no input layouts were recorded for this compile")
        return [
            InputFormat(TileLayout(tuple(d["major_to_minor"]), tuple(tuple(t) for t in d["tiling"])))
            for d in self.layouts
        ]


def cache_dirs() -> list[Path]:
    """The folders of `$FSDP_JAX_COMPILED_CACHE`, the writable one first."""
    return [Path(p) for p in os.environ.get(ENV, "").split(os.pathsep) if p]


def _flags(value: str) -> str:
    """The flags of an XLA_FLAGS-style string that change a program: sorted, without those
    that only name a file or folder to write to (a kernel cache, a dump) and those that only
    say how XLA:CPU splits its own code generation (`_WORK_FLAGS`: the test suite's)."""
    names = ((f, f.split("=")[0]) for f in value.split())
    flags = (f for f, name in names if not name.endswith(_PATH_FLAG_ENDINGS) and name not in _WORK_FLAGS)
    return " ".join(sorted(flags))


def _dumps(compiler_options: dict[str, Any] | None) -> bool:
    """Whether this compile was asked to write XLA's dumps (which a cached answer would not)."""
    return "xla_dump_to" in (compiler_options or {}) or "--xla_dump_to" in os.environ.get("XLA_FLAGS", "")


def program_key(
    lowered, devices: Iterable, compiler_options: dict[str, Any] | None = None, *, located: bool = False
) -> str:
    """The cache key of compiling `lowered` for `devices` with `compiler_options`; `located`:
    the key before kernels were read without their source locations (`keyed_text`), which the
    entries written before then carry."""
    devices = list(devices)
    h = hashlib.sha256()
    parts = [
        f"format {FORMAT}",
        TOOLCHAIN,
        f"platform {devices[0].platform} {getattr(devices[0].client, 'platform_version', '')}",
        json.dumps(sorted((compiler_options or {}).items()), default=str),
        *(f"{e}={_flags(os.environ.get(e, ''))}" for e in _FLAG_ENVS),
        *(f"{d.id} {d.device_kind} {getattr(d, 'coords', '')} {getattr(d, 'slice_index', '')}" for d in devices),
    ]
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    text = lowered.as_text()
    h.update((_PARTITIONER_ID.sub(r'\1"partitioner"', text) if located else keyed_text(text)).encode())
    return h.hexdigest()[:40]


def lookup(lowered, devices: Iterable, compiler_options: dict[str, Any] | None = None):
    """(the program's key, its entry or None): an entry under its key, or one written before
    kernels were keyed without their locations (the same program traced from the same lines of
    the same folder: the seeds of that time stay valid until they are replaced), which is then
    written again under its key (tests/compiled/seed.py takes it from there)."""
    devices = list(devices)
    key = program_key(lowered, devices, compiler_options)
    hit = load(key)
    if hit is None and _KERNEL_BODY.search(lowered.as_text()):
        hit = load(program_key(lowered, devices, compiler_options, located=True))
        if hit is not None:
            hit = dataclasses.replace(hit, key=key)
            store(hit)
    return key, hit


_PARTITIONER_ID = re.compile(r'(@CustomSPMDPartitioning\(.*?backend_config = )"\d+"')
# a Pallas / Mosaic kernel's serialized MLIR, base64 in its custom call's backend_config
_KERNEL_BODY = re.compile(r"(\\22body\\22: \\22)([A-Za-z0-9+/=]+)(\\22)")
_SOURCE_FOLDER = re.compile(rb"/[\w.+-]+(?:/[\w.+-]+)*/(?:(?:site|dist)-packages/|(?=fsdp_jax/))")


def kernel_text(body: bytes) -> bytes:
    """A Mosaic kernel's serialized MLIR as the key reads it: the module printed without its
    source locations (where the kernel was traced: a folder and a line of this checkout), or,
    where this jaxlib cannot read it back, the bytes without the checkout's and site-packages'
    folders."""
    context = mlir.make_ir_context()
    tpu.register_dialect(context)
    with context:
        context.allow_unregistered_dialects = True
        try:
            return ir.Module.parse(body).operation.get_asm(enable_debug_info=False).encode()
        except ir.MLIRError:
            return _SOURCE_FOLDER.sub(b"", body.replace(_CHECKOUT.encode(), b""))


def _kernel_body(match: re.Match) -> str:
    try:
        body = base64.b64decode(match.group(2), validate=True)
    except ValueError:
        return match.group(0)
    return match.group(1) + base64.b64encode(kernel_text(body)).decode() + match.group(3)


def keyed_text(text: str) -> str:
    """The lowered program's text as the key reads it: each custom-partitioning call's
    partitioner named by its position, not by its Python object's address in this process;
    each Pallas kernel's serialized MLIR without its source locations (`kernel_text`): they
    name this clone's folder and the kernel's source lines, so a program with a splash or
    tokamax kernel was found again only from the same folder and the same lines."""
    return _KERNEL_BODY.sub(_kernel_body, _PARTITIONER_ID.sub(r'\1"partitioner"', text))


def program_text(hlo: str) -> str:
    """The optimized HLO without its stack-frame tables (`FileNames`, `FunctionNames`,
    `FileLocations`, `StackFrames`: where in this machine's checkout each op was traced), and
    without the checkout's or site-packages' folder where a kernel's serialized MLIR names its
    source files (Mosaic GPU custom calls): `fsdp_jax/app/models/moe.py`, not where it lives."""
    out, skipping = [], False
    for line in hlo.split("\n"):
        if line in _STACK_TABLES:
            skipping = True
        elif skipping and not (line == "" or line[0].isdigit() or line[0] == " "):
            skipping = False
        if not skipping:
            out.append(line)
    text = "\n".join(out).replace(_CHECKOUT, "")  # kernels' serialized MLIR keeps source paths
    return _STORED_BODY.sub(_body_without_folders, _PACKAGES.sub("", text))


# a TPU kernel's serialized MLIR in the optimized HLO (base64): kept without its folders
_STORED_BODY = re.compile(r'("body":")([A-Za-z0-9+/=]{16,})(")')


def _body_without_folders(match: re.Match) -> str:
    """The kernel body of an optimized program's text without the checkout's and site-packages'
    folders in its locations (nothing reads the kernel back; the folders name this machine)."""
    try:
        body = base64.b64decode(match.group(2), validate=True)
    except ValueError:
        return match.group(0)
    body = _SOURCE_FOLDER.sub(b"", body.replace(_CHECKOUT.encode(), b""))
    return match.group(1) + base64.b64encode(body).decode() + match.group(3)


def _layouts(compiled) -> tuple[list[dict[str, Any]] | None, str | None]:
    try:
        formats = jax.tree.leaves(compiled.input_formats, is_leaf=lambda f: hasattr(f, "layout"))
        return [
            {
                "major_to_minor": [int(i) for i in f.layout.major_to_minor],
                "tiling": [[int(t) for t in tile] for tile in (f.layout.tiling or ())],
            }
            for f in formats
        ], None
    except (ValueError, AttributeError, TypeError) as e:  # jax 0.10.2: a microbatched splash step's formats
        return None, str(e)


def _facts(key: str, compiled, compile_s: float) -> CompiledFacts:
    ma = compiled.memory_analysis()
    memory = {f: int(getattr(ma, f)) for f in _MEMORY_FIELDS if getattr(ma, f, None) is not None}
    layouts, error = _layouts(compiled)
    cost = compiled.cost_analysis()
    cost = cost[0] if isinstance(cost, list | tuple) else cost  # older jax: one dict per program
    cost = {k: float(v) for k, v in (cost or {}).items()}
    return CompiledFacts(key, program_text(compiled.as_text()), memory, layouts, error, compile_s, cost=cost)


def load(key: str) -> CompiledFacts | None:
    """The entry for `key` in any cache folder, or None."""
    for d in cache_dirs():
        path = d / f"{key}.json.xz"
        try:
            doc = json.loads(lzma.decompress(path.read_bytes()))
        except (OSError, ValueError, lzma.LZMAError):
            continue
        if doc.get("format") == FORMAT and doc.get("key") == key:
            return CompiledFacts(
                key,
                doc["text"],
                doc["memory"],
                doc["layouts"],
                doc["layouts_error"],
                doc["compile_s"],
                doc["refused"],
                doc["cost"],
            )
    return None


def store(facts: CompiledFacts) -> Path | None:
    """Write `facts` to the first cache folder (atomically); None when there is none or it
    cannot be written (a cache is best effort)."""
    dirs = cache_dirs()
    if not dirs:
        return None
    doc = {"format": FORMAT, "toolchain": TOOLCHAIN, **dataclasses.asdict(facts)}
    path = dirs[0] / f"{facts.key}.json.xz"
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    try:
        dirs[0].mkdir(parents=True, exist_ok=True)
        tmp.write_bytes(lzma.compress(json.dumps(doc).encode(), preset=6))
        tmp.replace(path)
    except OSError:
        tmp.unlink(missing_ok=True)
        return None
    return path


def compile_lowered(lowered, devices: Iterable, compiler_options: dict[str, Any] | None = None):
    """`lowered.compile(compiler_options)`, served from the cache for deviceless targets."""
    devices = list(devices)
    compile_args = {"compiler_options": compiler_options} if compiler_options else {}
    if not cache_dirs() or devices[0].platform == "cpu":
        return lowered.compile(**compile_args)
    key, hit = lookup(lowered, devices, compiler_options)
    hit = None if _dumps(compiler_options) else hit  # a dump asked for needs the compile
    if hit is not None and hit.refused:
        raise CompileRefused(hit.refused)
    if hit is not None:
        return hit
    t0 = time.perf_counter()
    try:
        compiled = lowered.compile(**compile_args)
    except Exception as e:  # XLA:TPU refuses a program over its HBM: the same program is refused again
        if _REFUSAL not in str(e):
            raise
        store(CompiledFacts(key, "", {}, None, None, time.perf_counter() - t0, refused=str(e)))
        raise
    facts = _facts(key, compiled, time.perf_counter() - t0)
    store(facts)
    return facts  # a hit and a miss answer alike
