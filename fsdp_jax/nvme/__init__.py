"""Offload to local disks (`offload: optimizer:nvme`): the optimizer state of the scanned
layers in one file per layer, streamed through a per-layer update.

layer_files  the files: layout of a layer's shards, dir checks and claims, direct I/O + CRC
step         the train step over them: grads, then read i+1 | update i | write i-1
layerwise    optimizer+params:nvme's step: params, state and grads in the files, the forward
             and backward fed a layer at a time (the trainer runs it: app.trainer.params_nvme)
"""

from fsdp_jax.nvme.layer_files import LayerFiles, Layout
from fsdp_jax.nvme.layerwise import LayerwiseStep, Pieces
from fsdp_jax.nvme.step import HOST_BUFFERS, LAYERED, NvmeStep, check_streamable, labels_of
from fsdp_jax.sharding.offload_settings import NVME_OFFLOADS, PARAMS_NVME  # the settings this package serves

__all__ = [
    "HOST_BUFFERS",
    "LAYERED",
    "NVME_OFFLOADS",
    "PARAMS_NVME",
    "LayerFiles",
    "LayerwiseStep",
    "Layout",
    "NvmeStep",
    "Pieces",
    "check_streamable",
    "labels_of",
]
