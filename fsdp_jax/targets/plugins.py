"""The compile-only plugins a GPU or TPU target compiles with: the CUDA PJRT plugin (and
NVIDIA's cuDNN wheel) or libtpu, each pinned to the installed jaxlib and installed with
`pip install --target` into a private folder (`plugin_dir`), outside site-packages, so
normal CPU runs never load it (why: `fsdp_jax.targets.gpu`).

    python -m fsdp_jax.targets install            # the CUDA plugin and cuDNN
    python -m fsdp_jax.targets install tpu        # libtpu
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from importlib.metadata import version
from pathlib import Path

from fsdp_jax.targets import tpu

PLUGIN_PACKAGES = ("jax-cuda12-plugin", "jax-cuda12-pjrt")
INSTALL_HINT = "python -m fsdp_jax.targets install"


def installed_jax_version() -> str:
    """The jaxlib version: the CUDA plugin is built with, and pinned to, jaxlib (a jax
    patch release such as 0.12.0.1 may run on jaxlib 0.12.0)."""

    return version("jaxlib")


KINDS = ("cuda", "tpu")


def plugin_dir(jax_version: str | None = None, kind: str = "cuda") -> Path:
    """Where the compile-only plugin of `kind` for `jax_version` (default: the installed
    jaxlib's) lives. cuda: $FSDP_JAX_PLUGIN_DIR, else
    ~/.cache/fsdp_jax/cuda12-plugin-<jaxlib version>; tpu: $FSDP_JAX_LIBTPU_DIR, else
    ~/.cache/fsdp_jax/libtpu-<jaxlib version>."""
    base = os.environ.get("FSDP_JAX_LIBTPU_DIR" if kind == "tpu" else "FSDP_JAX_PLUGIN_DIR")
    if base:
        return Path(base)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    stem = "libtpu" if kind == "tpu" else "cuda12-plugin"
    return cache / "fsdp_jax" / f"{stem}-{jax_version or installed_jax_version()}"


def _libtpu_pinned(path: Path) -> bool:
    want = tpu.libtpu_requirement().split("==", 1)[-1]
    for info in path.glob("libtpu-*.dist-info"):
        have = info.name[len("libtpu-") : -len(".dist-info")]
        if have == want or (want.endswith("*") and have.startswith(want[:-1])):
            return (path / "libtpu" / "__init__.py").is_file()
    return False


def plugin_installed(path: Path | None = None, kind: str = "cuda") -> bool:
    """True when `path` (default `plugin_dir(kind=kind)`) holds the plugin pinned to this jax."""
    path = path or plugin_dir(kind=kind)
    if kind == "tpu":
        return _libtpu_pinned(path)
    v = installed_jax_version()
    return (
        (path / "jax_plugins" / "xla_cuda12" / "__init__.py").is_file()
        and (path / f"jax_cuda12_plugin-{v}.dist-info").is_dir()
        and (path / f"jax_cuda12_pjrt-{v}.dist-info").is_dir()
    )


CUDNN_PACKAGE = "nvidia-cudnn-cu12"


def cudnn_installed(path: Path | None = None) -> bool:
    """True when `path` (default `plugin_dir()`) also holds NVIDIA's cuDNN wheel, which
    `jax.nn.dot_product_attention(implementation="cudnn")` asks for while tracing."""
    path = path or plugin_dir()
    return any(path.glob("nvidia_cudnn_cu12-*.dist-info"))


def _cudnn_requirement(path: Path) -> str:
    """The plugin's own pin on cuDNN (its `with-cuda` extra), e.g. 'nvidia-cudnn-cu12<10.0,>=9.8'."""
    for meta in path.glob("jax_cuda12_plugin-*.dist-info/METADATA"):
        for line in meta.read_text().splitlines():
            if line.startswith("Requires-Dist:") and CUDNN_PACKAGE in line:
                return line.split(":", 1)[1].split(";", 1)[0].strip().replace(" ", "")
    return CUDNN_PACKAGE


def missing_message(kind: str = "cuda") -> str:
    if kind == "tpu":
        return (
            f"libtpu for jaxlib {installed_jax_version()} is not installed (looked in {plugin_dir(kind='tpu')}); "
            f"install it with `{INSTALL_HINT} tpu`"
        )
    return (
        f"the CUDA compile-only plugin for jaxlib {installed_jax_version()} is not installed (looked in "
        f"{plugin_dir()}); install it with `{INSTALL_HINT}`"
    )


def install(quiet: bool = True, kind: str = "cuda") -> Path:
    """Install the compile-only plugin of `kind`, pinned to the installed jaxlib, into
    `plugin_dir(kind=kind)` (pip --target --no-deps): cuda: jax-cuda12-plugin and
    jax-cuda12-pjrt (~480 MB), then NVIDIA's cuDNN wheel as the plugin pins it (for
    `attention: cudnn`; no other NVIDIA runtime wheel); tpu: the libtpu of jax's `tpu`
    extra, ~680 MB. Does nothing for what is already there. Raises RuntimeError when pip
    fails (e.g. no plugin exists for this jax version)."""
    dest = plugin_dir(kind=kind)
    if plugin_installed(dest, kind):
        return dest if kind == "tpu" else _install_cudnn(dest, quiet)
    v = installed_jax_version()
    packages = [tpu.libtpu_requirement()] if kind == "tpu" else [f"{p}=={v}" for p in PLUGIN_PACKAGES]
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=dest.name + ".", dir=dest.parent))
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-deps",
        "--target",
        str(tmp),
        *packages,
    ]
    proc = subprocess.run(cmd + (["-q"] if quiet else []), capture_output=quiet, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tail = (proc.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise RuntimeError(
            f"could not install {' and '.join(packages)} (the {kind} compile-only "
            f"plugin pinned to this jax): pip exited {proc.returncode}" + (f": {tail[0]}" if tail else "")
        )
    if dest.exists():
        shutil.rmtree(dest)
    tmp.rename(dest)  # atomic: a half-finished install is never taken for a whole one
    if not plugin_installed(dest, kind):
        raise RuntimeError(f"pip installed into {dest} but the {kind} plugin for jax {v} is not there")
    return dest if kind == "tpu" else _install_cudnn(dest, quiet)


def _install_cudnn(dest: Path, quiet: bool) -> Path:
    """NVIDIA's cuDNN wheel (pinned as the plugin pins it; ~720 MB download, 1.1 GB) into
    `dest`, next to the plugin, for compiles with `model.attention=cudnn`. cuDNN alone is
    enough for the deviceless compile (measured on jax 0.10.2: no cuBLAS or NVRTC wheel)."""
    if cudnn_installed(dest):
        return dest
    req = _cudnn_requirement(dest)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-deps",
        "--target",
        str(dest),
        req,
    ]
    proc = subprocess.run(cmd + (["-q"] if quiet else []), capture_output=quiet, text=True)
    if proc.returncode != 0 or not cudnn_installed(dest):
        tail = (proc.stderr or "").strip().splitlines()[-1:] if quiet else []
        raise RuntimeError(
            f"could not install {req} into {dest}: pip exited {proc.returncode}" + (f": {tail[0]}" if tail else "")
        )
    return dest
