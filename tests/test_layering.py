"""The library never imports the application, and `import fsdp_jax` stays light."""

import ast
import functools
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "fsdp_jax"


@functools.cache
def _tree(path: Path) -> ast.Module:
    """A source file parsed once for the whole module (the walks below read ~600 files each;
    parsing them per test, and a module again per import of it, was most of this file's time)."""
    return ast.parse(path.read_text())


@functools.cache
def _nodes(path: Path) -> tuple[ast.AST, ...]:
    return tuple(ast.walk(_tree(path)))


def _imports(path: Path) -> set[str]:
    out = set()
    for node in _nodes(path):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def test_library_modules_never_import_the_application():
    lib = [p for p in PKG.rglob("*.py") if "app" not in p.relative_to(PKG).parts]
    assert len(lib) > 10
    bad = {p.name: sorted(m for m in _imports(p) if m.startswith("fsdp_jax.app")) for p in lib}
    assert not {k: v for k, v in bad.items() if v}


def test_import_fsdp_jax_loads_neither_orbax_nor_the_trainer():
    # nor IPython (flax imports it only to ask whether it runs inside it: fsdp_jax.model.flax_import),
    # and IPython stays importable after (the ImportError stand-in is removed)
    # and then, in the same child (one start-up of jax and flax, not two), the lazy names resolve.
    # The face itself loads on first use: `import fsdp_jax` alone loads no JAX (the CLI refuses a bad
    # flag before it loads), every name of __all__ resolves, and `fsdp_jax.verify` stays the function
    # after the subpackage `fsdp_jax.verify` is imported
    code = (
        "import sys, fsdp_jax; light = 'jax' not in sys.modules; fsdp_jax.make_mesh; "
        "print(sorted(m for m in sys.modules if m.startswith("
        "('orbax', 'tensorstore', 'grain', 'fsdp_jax.app', 'fsdp_jax.checkpoint', 'IPython'))), "
        "sys.modules.get('IPython', 'absent')); "
        "import fsdp_jax.verify.report; from fsdp_jax import verify; "
        "print(fsdp_jax.checkpoint.Checkpointer.__name__, fsdp_jax.hlo.memory.shard_bytes.__name__, light, "
        "verify is fsdp_jax.verify and callable(verify), all(getattr(fsdp_jax, n) is not None for n in fsdp_jax.__all__))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, lazy = out.stdout.strip().split("\n")
    assert loaded == "[] absent"
    assert lazy.split() == ["Checkpointer", "shard_bytes", "True", "True", "True"]


# The floor plan, top to bottom: a package may import only from packages on a lower level
# (CONTRIBUTING.md "Layout"). Function-level imports count.
LEVELS = {
    "fsdp_jax.app.cli": 7,
    "fsdp_jax.app.verify_shrink": 6,
    "fsdp_jax.app.verify_batches": 6,
    "fsdp_jax.app.planner": 6,
    "fsdp_jax.app.trainer": 5,
    "fsdp_jax.app.hf": 4,
    "fsdp_jax.app.objectives": 4,
    "fsdp_jax.app.config": 3,
    "fsdp_jax.app.data": 3,
    "fsdp_jax.app.models": 2,
    "fsdp_jax.app.exits": 1,
    "fsdp_jax.app.devices": 1,
    "fsdp_jax.app.extras": 1,
    "fsdp_jax.app.host_memory": 1,
    "fsdp_jax.app.held_warnings": 1,
}


def _unit(module: str) -> str:
    """The package (or flat module) of the floor plan that `module` belongs to."""
    for unit in sorted(LEVELS, key=len, reverse=True):
        if module == unit or module.startswith(unit + "."):
            return unit
    return "fsdp_jax.app" if module.startswith("fsdp_jax.app") else "library"


def test_packages_import_only_downwards():
    app = PKG / "app"
    flat = sorted(p.stem for p in app.glob("*.py") if p.stem != "__init__")
    assert {f"fsdp_jax.app.{m}" for m in flat} <= set(LEVELS), "a new flat app module needs a level here"
    up = []
    for path in app.rglob("*.py"):
        me = "fsdp_jax." + ".".join(path.relative_to(PKG).with_suffix("").parts).removesuffix(".__init__")
        mine = LEVELS[_unit(me)] if _unit(me) in LEVELS else None
        for m in _imports(path):
            other = _unit(m)
            if mine is None or other in ("library", "fsdp_jax.app") or other == _unit(me):
                continue
            if LEVELS[other] >= mine:
                up.append(f"{me} -> {m}")
    assert not sorted(set(up))


def test_floor_plan_sizes():
    """At most 8 flat modules beside the sub-packages, in the library and in the app."""
    assert len([p for p in PKG.glob("*.py")]) <= 8
    assert len([p for p in (PKG / "app").glob("*.py")]) <= 8


@functools.cache
def _defined(path: Path) -> frozenset[str]:
    """Top-level names a module binds itself (not by importing them)."""
    out = set()
    for node in _nodes(path):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                out.update(n.id for n in ast.walk(t) if isinstance(n, ast.Name))
    return frozenset(out)


def test_names_are_imported_from_where_they_are_defined():
    """No compatibility layer: outside a package's `__init__` face, `from M import name` finds
    `name` defined in M (or a submodule), never a name M itself imported from a sibling;
    and no face re-exports a private name."""
    root = PKG.parent
    sources = [*PKG.rglob("*.py"), *(root / "tests").glob("*.py"), *(root / "scripts").glob("*.py")]
    sources += [*(root / "benchmarks").glob("*.py"), *(root / "examples").glob("*.py")]
    bad = []
    for path in sources:
        for node in _nodes(path):
            if not (isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_jax")):
                continue
            target = root / node.module.replace(".", "/")
            if (target / "__init__.py").is_file():  # a package: its face, or its submodules
                for a in node.names:
                    if a.name.startswith("_") and not (target / f"{a.name}.py").is_file():
                        bad.append(f"{path.name}: {node.module}.{a.name} (private, through a face)")
                continue
            defined = _defined(target.with_suffix(".py"))
            for a in node.names:
                if a.name not in defined:
                    bad.append(f"{path.relative_to(root)}: {node.module}.{a.name} (not defined there)")
    faces = [p for p in PKG.rglob("__init__.py")]
    for face in faces:
        for node in _tree(face).body:
            if isinstance(node, ast.ImportFrom):
                bad += [f"{face.relative_to(root)}: re-exports {a.name}" for a in node.names if a.name.startswith("_")]
    assert not bad


def _library_modules() -> list[tuple[Path, str]]:
    return [(p, "fsdp_jax." + ".".join(p.relative_to(PKG).with_suffix("").parts)) for p in sorted(PKG.rglob("*.py"))]


def test_few_function_level_imports():
    """Arrows you can see: an import inside a function only for an optional extra (orbax,
    matplotlib, tokamax, ...), what `import fsdp_jax` must not load, or a real cycle; the rest at
    the module's top (the CLI's start-up boundary is `entry.command_module`)."""
    inside = []
    for path, _ in _library_modules():
        for fn in _nodes(path):
            if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                inside += [
                    f"{path.relative_to(PKG.parent)}:{n.lineno} in {fn.name}"
                    for n in ast.walk(fn)
                    if isinstance(n, (ast.Import, ast.ImportFrom))
                ]
    assert len(inside) <= 40, "function-level imports (at most 40):\n" + "\n".join(sorted(set(inside)))


def test_no_private_name_is_imported_across_modules():
    """`from fsdp_jax.x import _name` only from the module's own package face for a submodule:
    a private name used by another module is promoted to public, or the code moves."""
    bad = []
    for path, me in _library_modules():
        for node in _nodes(path):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("fsdp_jax"):
                target = PKG.parent / node.module.replace(".", "/")
                for a in node.names:
                    if a.name.startswith("_") and not (target / f"{a.name}.py").is_file() and node.module != me:
                        bad.append(f"{path.relative_to(PKG.parent)}:{node.lineno}: {node.module}.{a.name}")
    assert not bad, "private names imported across modules:\n" + "\n".join(bad)


def _classes() -> list[tuple[Path, ast.ClassDef]]:
    return [(p, n) for p, _ in _library_modules() for n in _nodes(p) if isinstance(n, ast.ClassDef)]


def test_errors_live_in_the_errors_module():
    """Every exception (and warning) class the project defines is in `fsdp_jax/errors.py`;
    the modules that raise them import them from there."""
    import builtins

    exceptions = {n for n, v in vars(builtins).items() if isinstance(v, type) and issubclass(v, BaseException)}
    classes = _classes()
    changed = True
    while changed:  # a class is an exception when one of its bases is (by name, to a fixed point)
        bases = {c.name for _, c in classes if any(_base_name(b) in exceptions for b in c.bases)}
        changed = not bases <= exceptions
        exceptions |= bases
    elsewhere = [f"{p.relative_to(PKG.parent)}:{c.lineno} {c.name}" for p, c in classes if c.name in exceptions]
    elsewhere = [e for e in elsewhere if not e.startswith("fsdp_jax/errors.py:")]
    assert len(exceptions) > 20 and not elsewhere, elsewhere


def _base_name(node: ast.expr) -> str:
    return node.attr if isinstance(node, ast.Attribute) else getattr(node, "id", "")


def test_one_class_per_name():
    """One word per idea: no class name is defined twice in the package (one `Target`, the
    compile target; LoRA's weight with an adapter is `AdaptedWeight`)."""
    seen: dict[str, list[str]] = {}
    for p, c in _classes():
        seen.setdefault(c.name, []).append(str(p.relative_to(PKG.parent)))
    assert not {k: v for k, v in seen.items() if len(v) > 1}


# Aliases kept: conventional short names of third-party modules, and names of third-party
# modules whose own name would say less or clash (`fsdp_jax` as `fj`, as in the examples).
CONVENTIONAL_ALIASES = {
    "numpy": "np",
    "jax.numpy": "jnp",
    "flax.linen": "nn",
    "jax.sharding.PartitionSpec": "P",
    "matplotlib.pyplot": "plt",
    "pyarrow.parquet": "pq",
    "orbax.checkpoint": "ocp",
    "orbax.checkpoint.args": "ocp_args",
    "orbax.checkpoint._src.futures.future": "_future",
    "concurrent.futures": "cf",
    "sentencepiece": "spm",
    "tokenizers.Tokenizer": "HFTokenizer",
    "zlib.crc32": "_crc32",
    "zlib_ng.zlib_ng.crc32": "_crc32",
    "zlib_ng.zlib_ng.crc32_combine": "_crc32_combine",
    "jax.extend.core": "jcore",
    "jax._src.config": "jax_config",
    "jax._src.distributed": "jax_distributed",
    "jax._src.cudnn.fused_attention_stablehlo": "fa",
    "jax._src.cudnn.fused_attention_stablehlo.dot_product_attention": "cudnn_attn",
    "jax.experimental.pallas.ops.tpu.splash_attention": "sa",
    "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_kernel": "sk_mod",
    "jax.experimental.pallas.ops.tpu.splash_attention.splash_attention_mask_info": "mi",
    "fsdp_jax": "fj",
}


def test_imports_keep_their_own_names():
    """No import alias to an old or short name (`targets.gpu as targets`, `hf.load as hf`,
    `rules as rl`, `lora as lora_lib`) in the package, its scripts, benchmarks and examples
    (the tests keep theirs): a module or name is imported as itself, apart from
    the conventional third-party aliases above (one alias each). Where its own name is taken
    in the importing module, import the names it uses instead."""
    root = PKG.parent
    sources = [*PKG.rglob("*.py"), *(root / "scripts").glob("*.py")]
    sources += [*(root / "benchmarks").glob("*.py"), *(root / "examples").glob("*.py")]
    bad = []
    for path in sources:
        for node in _nodes(path):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for a in node.names:
                full = a.name if isinstance(node, ast.Import) else f"{node.module}.{a.name}"
                if a.asname and a.asname != a.name.split(".")[-1] and CONVENTIONAL_ALIASES.get(full) != a.asname:
                    bad.append(f"{path.relative_to(root)}:{node.lineno}: {full} as {a.asname}")
    assert not bad, "import aliases (import the module under its own name):\n" + "\n".join(bad)


def test_lazy_faces_show_their_names_to_static_tools():
    """A face that loads on first use (`_FACE`: the top-level one, `fsdp_jax.lazy_face`'s) imports
    exactly its `_FACE` names under `if TYPE_CHECKING:`, so IDEs and type checkers see them, and
    nothing else at run time; the top-level `__all__` lists them all."""
    faces = [  # module -> names (fsdp_jax.checkpoint's name -> module face imports orbax only when read)
        p
        for p in PKG.rglob("__init__.py")
        if any(isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "_FACE" for n in _tree(p).body)
    ]
    assert {str(p.relative_to(PKG)) for p in faces} >= {
        "__init__.py",
        "sharding/__init__.py",
        "app/models/__init__.py",
        "app/config/__init__.py",
    }
    for path in faces:
        tree = _tree(path)
        face = next(
            ast.literal_eval(n.value)
            for n in tree.body
            if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", "") == "_FACE"
        )
        blocks = [n for n in tree.body if isinstance(n, ast.If) and getattr(n.test, "id", "") == "TYPE_CHECKING"]
        assert len(blocks) == 1, path
        seen: dict[str, tuple[str, ...]] = {}
        for node in blocks[0].body:
            assert isinstance(node, ast.ImportFrom), (path, ast.dump(node))
            seen[node.module] = seen.get(node.module, ()) + tuple(a.name for a in node.names)
        assert {m: sorted(n) for m, n in seen.items()} == {m: sorted(n) for m, n in face.items()}, path
        others = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
        assert all(
            not (n.module or "").startswith("fsdp_jax.") or n.module == "fsdp_jax.lazy_face"
            for n in others
            if isinstance(n, ast.ImportFrom)
        ), path
    top = _tree(PKG / "__init__.py")
    names = next(
        ast.literal_eval(n.value) for n in top.body if isinstance(n, ast.Assign) and n.targets[0].id == "__all__"
    )
    face = next(ast.literal_eval(n.value) for n in top.body if isinstance(n, ast.AnnAssign) and n.target.id == "_FACE")
    assert {a for attrs in face.values() for a in attrs} <= set(names)
