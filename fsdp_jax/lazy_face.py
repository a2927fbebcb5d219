"""A package face that loads on first use (PEP 562), for faces over JAX-importing modules.

    __getattr__, __dir__ = lazy_face(__name__, {"fsdp_jax.sharding.mesh": ("make_mesh",), ...})

Reading a face name imports the module that defines it and binds that module's face names in
the package, so `from package import name` and `package.name` behave as an eager face's
imports did; importing a submodule (`fsdp_jax.sharding.axes`) no longer runs the others. This
is what lets the run config's schema and checks read their name lists from the library
without loading JAX (a refused config costs ~0.1 s of CPU, not ~3 s).
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_face(
    package: str, face: Mapping[str, tuple[str, ...]]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """(`__getattr__`, `__dir__`) for `package`'s `__init__`: `face` maps a module to the names
    of the face it defines. An unknown name raises AttributeError (so `from package import
    submodule` imports the submodule, as Python does for a name the package lacks)."""
    owner = {name: module for module, names in face.items() for name in names}

    def getattr_(name: str) -> object:
        module = owner.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        loaded = importlib.import_module(module)
        namespace = vars(sys.modules[package])
        namespace.update({n: getattr(loaded, n) for n in face[module]})
        return namespace[name]

    def dir_() -> list[str]:
        return sorted({*vars(sys.modules[package]), *owner})

    return getattr_, dir_
