"""Compile for a GPU cluster or TPU slice on a machine without one (deviceless AOT).

    gpu        GPU targets (data: gpu_targets/*.txtpb) and the target-compile child
    tpu        TPU generations' published specifications, slice topologies
    plugins    the compile-only CUDA plugin and libtpu, in private folders
    xla_flags  XLA GPU flags for FSDP, chosen by what they change in the schedule
    perf       peak FLOP/s per device kind, MFU, timing

`python -m fsdp_jax.targets install [cuda|tpu|all]` installs the plugins.
"""

from fsdp_jax.targets.gpu import Target, device_memory, make_target, target_names

__all__ = ["Target", "device_memory", "make_target", "target_names"]
