"""The application on top of the library: the reference trainer and its tools.

Config (`config`), data pipeline (`data`), reference model (`models`), optimizer
from config (`optim`), the training loop (`loop`), metrics and sampling
(`metrics_log`, `metrics_plot`), preemption signals (`preemption`), every command
(`cli`: `fsdp-jax` and the scripts/ shims), the planner ("will it fit, how fast": `fit`,
a package of its own), real
tokenizers (`tokenizer`) and Hugging Face Llama checkpoints in (`hf`) and out
(`hf_export`), over the library's sliced safetensors I/O (`fsdp_jax.safetensors_io`).

The library (`fsdp_jax.*` outside this package) never imports from here.
"""

import importlib
import importlib.abc
import importlib.util
import sys

# Modules that moved; their old paths keep importing the same module objects (so a
# monkeypatch on either name patches both). Old path -> new path, relative to this package.
MOVED = {
    "planner": "fit.estimate",
    "plan_report": "fit.report",
    "memory_model": "fit.memory_model",
    "step_time": "fit.step_time",
    "step_build": "fit.step_build",
}


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Resolves `fsdp_jax.app.<old>` to the module now at `fsdp_jax.app.<new>`."""

    def find_spec(self, name, path=None, target=None):
        pkg, _, leaf = name.rpartition(".")
        if pkg == __name__ and leaf in MOVED:
            return importlib.util.spec_from_loader(name, self)
        return None

    def create_module(self, spec):
        return importlib.import_module(f"{__name__}.{MOVED[spec.name.rpartition('.')[2]]}")

    def exec_module(self, module):
        pass  # already executed under its new name


if not any(isinstance(f, _MovedModules) for f in sys.meta_path):
    sys.meta_path.append(_MovedModules())
