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
    code = "import fsdp_jax; print(fsdp_jax.checkpoint.Checkpointer.__name__, fsdp_jax.memory.shard_bytes.__name__)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["Checkpointer", "shard_bytes"]


def test_moved_planner_modules_keep_their_old_import_paths():
    """Scripts written against the flat planner (`fsdp_jax.app.planner`, ...) keep working:
    each old path is the new module object itself, so a monkeypatch on either patches both."""
    import importlib

    from fsdp_jax import app

    assert app.MOVED  # the table this test walks
    for old, new in app.MOVED.items():
        assert importlib.import_module(f"fsdp_jax.app.{old}") is importlib.import_module(f"fsdp_jax.app.{new}")
    from fsdp_jax.app.planner import plan_config  # the `from` form the old docs used

    assert plan_config is importlib.import_module("fsdp_jax.app.fit.estimate").plan_config
