"""Compile for a GPU cluster or TPU slice on a machine without one (deviceless AOT).

    gpu        GPU targets (data: gpu_targets/*.txtpb) and the target-compile child
    tpu        TPU generations' published specifications, slice topologies
    plugins    the compile-only CUDA plugin and libtpu, in private folders
    xla_flags  XLA GPU flags for FSDP, chosen by what they change in the schedule
    perf       peak FLOP/s per device kind, MFU, timing

`python -m fsdp_jax.targets install [cuda|tpu|all]` installs the plugins.
"""

from typing import TYPE_CHECKING

from fsdp_jax.lazy_face import lazy_face

if TYPE_CHECKING:  # what static tools see; at run time each name loads on first use
    from fsdp_jax.targets.gpu import Target, device_memory, make_target, target_names

# module -> the names of the face it defines (loaded on first use: `fsdp_jax.lazy_face`), so
# `fsdp_jax.targets.xla_flags` loads without JAX: a command checks XLA_FLAGS before JAX starts
_FACE: dict[str, tuple[str, ...]] = {
    "fsdp_jax.targets.gpu": ("Target", "device_memory", "make_target", "target_names"),
}
__getattr__, __dir__ = lazy_face(__name__, _FACE)

__all__ = ["Target", "device_memory", "make_target", "target_names"]
