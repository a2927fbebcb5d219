"""A deviceless compile kept by its program (fsdp_jax.targets.compile_cache): the plan served
from the cache equals the plan compiled, a different program is a new entry, a damaged entry is
a miss, and a refusal is kept with the compiler's message."""

import json

import pytest

from fsdp_jax.errors import CompileRefused
from fsdp_jax.targets import compile_cache
from helpers import plans_in_one_child

PLAN = ("--config", "configs/tiny.yaml", "--target", "h100", "--devices", 8, "--json")

# run in the plans' child between the second plan and the third: the entries and their times, then
# the first plan's entry (the one entry `first` names: its times before the second plan) copied
# aside and damaged (`plans_in_one_child`: code between plans)
ENTRIES = "result = {p.name: p.stat().st_mtime_ns for p in pathlib.Path(CACHE).glob('*.json.xz')}"
DAMAGE = """
for name in first:
    entry = pathlib.Path(CACHE) / name
    (pathlib.Path(KEPT) / name).write_bytes(entry.read_bytes())
    entry.write_bytes(b"not xz")
"""


def _plan(result):
    rc, out, err = result
    assert rc == 0, err[-2000:]
    doc = json.loads(out)
    doc.pop("wall_s")  # what a hit may change: how long things took on this machine
    for s in doc["strategies"].values():
        for timing in ("compile_s", "op_inventory_s"):
            s.pop(timing)
        s["predicted"].pop("predict_s")
    return doc


def _entries(cache):
    return sorted(p.name for p in cache.glob("*.json.xz"))


@pytest.mark.slow  # three tiny H100 plans (three compiles, one hit)
def test_a_hit_plans_what_the_compile_planned_and_a_new_program_is_a_new_entry(tmp_path, monkeypatch):
    """The three plans in one child (`helpers.plans_in_one_child`: the command as `call` runs it,
    its compile child in the same process: one Python, JAX and plugin start-up, not three): the
    first compiles full_shard; the second plans the kept program and a new one (full_shard a hit,
    no_shard a new entry); the third, once the first entry was damaged, compiles full_shard again."""
    from fsdp_jax.targets import gpu as targets

    cache, kept_dir = tmp_path / "compiled", tmp_path / "kept"
    cache.mkdir()
    kept_dir.mkdir()
    monkeypatch.setenv(compile_cache.ENV, str(cache))
    where = f"CACHE, KEPT = {str(cache)!r}, {str(kept_dir)!r}\n"
    one, entries, both, after, again = plans_in_one_child(
        targets.make_target("h100", devices=8),
        [
            [*PLAN, "--strategies", "full_shard"],
            where + ENTRIES + "\nfirst = result",
            [*PLAN, "--strategies", "full_shard,no_shard"],
            where + ENTRIES + DAMAGE,
            [*PLAN, "--strategies", "full_shard"],
        ],
    )
    first = _plan(one)
    ((entry, stamp),) = entries.items()
    monkeypatch.setenv(compile_cache.ENV, str(kept_dir))  # the first plan's entry, as it wrote it
    kept = compile_cache.load(entry.removesuffix(".json.xz"))
    assert "ENTRY" in kept.text and "fsdp_jax/" not in kept.text  # the program, not where it was traced
    assert kept.memory["temp_size_in_bytes"] > 0 and kept.layouts and kept.compile_s > 0
    both = _plan(both)
    fs = both["strategies"]["full_shard"]
    assert fs == first["strategies"]["full_shard"]  # memory, ops, predicted time: from the kept text and bytes
    assert after[entry] == stamp  # the hit did not write its entry again
    (other,) = set(after) - {entry}
    assert both["strategies"]["no_shard"]["compiled"] != fs["compiled"]
    assert _plan(again) == first  # a damaged entry is a miss: compiled again and rewritten
    assert (cache / entry).read_bytes()[:6] == b"\xfd7zXZ\x00" and _entries(cache) == sorted([entry, other])


def test_a_refusal_is_kept_and_raised_again(tmp_path, monkeypatch):
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    facts = compile_cache.CompiledFacts("k" * 40, "", {}, None, None, 1.0, refused="RESOURCE_EXHAUSTED: Ran out")
    compile_cache.store(facts)

    class Lowered:
        def as_text(self):
            return "module"

        def compile(self, **_):
            raise AssertionError("a kept refusal must not compile again")

    class Device:
        platform, id, device_kind = "tpu", 0, "TPU v5p"
        client = None

    monkeypatch.setattr(compile_cache, "program_key", lambda *a: "k" * 40)
    with pytest.raises(CompileRefused, match="RESOURCE_EXHAUSTED"):
        compile_cache.compile_lowered(Lowered(), [Device()])


def test_without_a_cache_folder_or_on_cpu_nothing_is_kept(tmp_path, monkeypatch):
    class Lowered:
        def compile(self, **_):
            return "compiled"

    class Cpu:
        platform = "cpu"

    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    assert compile_cache.compile_lowered(Lowered(), [Cpu()]) == "compiled"
    monkeypatch.delenv(compile_cache.ENV)
    assert compile_cache.compile_lowered(Lowered(), [type("Gpu", (), {"platform": "gpu"})()]) == "compiled"
    assert not list(tmp_path.iterdir())


def test_flags_that_name_a_file_are_not_the_program_and_a_dump_always_compiles(monkeypatch, tmp_path):
    kernels = "--xla_gpu_kernel_cache_file=/scratch/a/k.bin"
    assert compile_cache._flags(f"--b=1 {kernels} --a=2") == compile_cache._flags("--a=2 --b=1")
    assert compile_cache._flags("--a=2") != compile_cache._flags("--a=3")
    # how XLA:CPU splits its codegen (the suite's flag, tests/conftest.py) is not the program: seeds still answer
    assert compile_cache._flags("--a=2 --xla_cpu_parallel_codegen_split_count=1") == compile_cache._flags("--a=2")
    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    monkeypatch.setattr(compile_cache, "program_key", lambda *a: "d" * 40)
    compile_cache.store(compile_cache.CompiledFacts("d" * 40, "kept", {}, None, None, 1.0))
    compiles = []

    class Lowered:
        def compile(self, **kw):
            compiles.append(kw)
            raise RuntimeError("compiled")

    gpu = type("Gpu", (), {"platform": "gpu"})()
    assert compile_cache.compile_lowered(Lowered(), [gpu]).as_text() == "kept"
    with pytest.raises(RuntimeError, match="compiled"):
        compile_cache.compile_lowered(Lowered(), [gpu], {"xla_dump_to": str(tmp_path)})
    assert compiles == [{"compiler_options": {"xla_dump_to": str(tmp_path)}}]


def _partitioned():
    """A fresh `custom_partitioning` of the same function: a new Python partitioner object, as
    each process has its own (cuDNN attention's and the ring's calls are such)."""
    import jax
    from jax.experimental.custom_partitioning import custom_partitioning

    @custom_partitioning
    def double(x):
        return 2 * x

    def partition(mesh, arg_shapes, result_shape):
        return mesh, lambda x: 2 * x, result_shape.sharding, (arg_shapes[0].sharding,)

    double.def_partition(
        partition=partition,
        infer_sharding_from_operands=lambda mesh, arg_shapes, result_shape: arg_shapes[0].sharding,
        sharding_rule="i j -> i j",
    )
    mesh = jax.sharding.Mesh(jax.devices()[:8], ("x",))
    rows = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("x"))
    return jax.jit(double, in_shardings=rows, out_shardings=rows).lower(jax.ShapeDtypeStruct((8, 4), "float32"))


def test_a_custom_partitioning_call_keys_alike_whatever_its_partitioner_objects_address():
    """The lowered text names the Python partitioner by its address in this process; two
    lowerings of the same program with different partitioner objects have one key (the
    seeds of every cuDNN program missed in every other process before)."""
    import jax

    a, b = _partitioned(), _partitioned()
    assert "@CustomSPMDPartitioning" in a.as_text() and a.as_text() != b.as_text()
    devices = jax.devices()[:8]
    assert compile_cache.program_key(a, devices) == compile_cache.program_key(b, devices)


def _kernel_body(folder: str, line: int, op: str = "arith.addi") -> bytes:
    """A kernel's MLIR serialized as Mosaic serializes it (bytecode), its ops located at `line`
    of `folder`fsdp_jax/app/models/moe.py."""
    import io

    from jax._src.interpreters import mlir
    from jaxlib.mlir import ir

    where = f'loc("{folder}fsdp_jax/app/models/moe.py":{line}:5)'
    src = (
        "module {\n  func.func @main(%a: i32, %b: i32) -> i32 {\n"
        f"    %0 = {op} %a, %b : i32 {where}\n    return %0 : i32 {where}\n  }}\n}}"
    )
    with mlir.make_ir_context():
        buf = io.BytesIO()
        ir.Module.parse(src).operation.write_bytecode(buf, desired_version=0)
        return buf.getvalue()


def _kernel_program(body: bytes):
    """A lowered program's text with one Pallas kernel call carrying `body` (base64, as jax
    writes it into the call's backend_config)."""
    import base64
    import types

    call = (
        'stablehlo.custom_call @tpu_custom_call(%arg0) {backend_config = "{\\22custom_call_config\\22: '
        f'{{\\22body\\22: \\22{base64.b64encode(body).decode()}\\22, \\22serialization_format\\22: 1}}}}"}}'
    )
    return types.SimpleNamespace(as_text=lambda: f"module @jit_step {{\n  {call}\n}}\n")


def test_a_kernels_source_locations_are_not_in_the_key():
    """A splash / tokamax kernel's serialized MLIR names where it was traced: the checkout's
    folder and the source line. The same kernel traced in another clone, or after an edit moved
    its lines, has the same key (the Mixtral row's seed missed in every other checkout and after
    every edit of moe.py); another kernel has another key."""
    import base64

    import jax

    devices = jax.devices()[:8]
    key = compile_cache.program_key
    here = key(_kernel_program(_kernel_body(compile_cache._CHECKOUT, 158)), devices)
    assert key(_kernel_program(_kernel_body("/srv/ci/clone/", 182)), devices) == here
    assert key(_kernel_program(_kernel_body(compile_cache._CHECKOUT, 158, "arith.muli")), devices) != here
    # a body this jaxlib cannot read back keys without its folders, its bytes otherwise kept
    raw = b"ML\xefR\x00{}fsdp_jax/app/models/moe.py\x00{}jax/k.py\x00"
    mine = raw.replace(b"{}", compile_cache._CHECKOUT.encode(), 1).replace(b"{}", b"/usr/lib/python3/site-packages/")
    theirs = raw.replace(b"{}", b"/srv/ci/clone/", 1).replace(b"{}", b"/srv/ci/venv/lib/python3.11/site-packages/")
    assert key(_kernel_program(mine), devices) == key(_kernel_program(theirs), devices)
    assert key(_kernel_program(mine), devices) != key(_kernel_program(mine.replace(b"moe", b"mlp")), devices)
    # and the optimized program kept in the cache names no folder of this machine in its kernels
    stored = compile_cache.program_text(f'custom_call_config":{{"body":"{base64.b64encode(mine).decode()}"}}')
    kept = base64.b64decode(stored.split('"body":"')[1].split('"')[0])
    assert b"/" + b"fsdp_jax/app/models/moe.py" not in kept and kept.startswith(
        b"ML\xefR\x00fsdp_jax/app/models/moe.py"
    )


def test_an_entry_written_before_kernels_were_keyed_without_locations_is_still_found(tmp_path, monkeypatch):
    """The seeds of programs with kernels were written under the key that read the kernel with
    its locations: the same lowering finds them (another line of the kernel does not) and
    writes them again under the key without locations."""
    import jax

    monkeypatch.setenv(compile_cache.ENV, str(tmp_path))
    devices = jax.devices()[:8]
    program = _kernel_program(_kernel_body(compile_cache._CHECKOUT, 158))
    located = compile_cache.program_key(program, devices, located=True)
    assert located != compile_cache.program_key(program, devices)
    compile_cache.store(compile_cache.CompiledFacts(located, "HloModule seeded", {}, None, None, 12.0))
    moved = _kernel_program(_kernel_body(compile_cache._CHECKOUT, 159))
    assert compile_cache.lookup(moved, devices)[1] is None  # the old key held the line
    key, hit = compile_cache.lookup(program, devices)
    assert key == compile_cache.program_key(program, devices) and hit.as_text() == "HloModule seeded"
    assert compile_cache.load(key).as_text() == "HloModule seeded"  # written again under its key
    assert compile_cache.lookup(moved, devices)[1].as_text() == "HloModule seeded"  # which holds no line
