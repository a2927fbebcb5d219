"""The library never imports the application, and `import fsdp_jax` stays light."""

import ast
import subprocess
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "fsdp_jax"


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
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
    code = (
        "import sys, fsdp_jax; print(sorted(m for m in sys.modules if m.startswith("
        "('orbax', 'tensorstore', 'grain', 'fsdp_jax.app', 'fsdp_jax.checkpoint'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    # and the lazy names still resolve
    code = "import fsdp_jax; print(fsdp_jax.checkpoint.Checkpointer.__name__, fsdp_jax.hlo.memory.shard_bytes.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Checkpointer", "shard_bytes"]


# The floor plan, top to bottom: a package may import only from packages on a lower level
# (CONTRIBUTING.md "Layout"). Function-level imports count.
LEVELS = {
    "fsdp_jax.app.cli": 7,
    "fsdp_jax.app.verify_shrink": 6,
    "fsdp_jax.app.verify_batches": 6,
    "fsdp_jax.app.planner": 6,
    "fsdp_jax.app.trainer": 5,
    "fsdp_jax.app.hf": 4,
    "fsdp_jax.app.config": 3,
    "fsdp_jax.app.data": 3,
    "fsdp_jax.app.models": 2,
    "fsdp_jax.app.exits": 1,
    "fsdp_jax.app.devices": 1,
    "fsdp_jax.app.extras": 1,
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
