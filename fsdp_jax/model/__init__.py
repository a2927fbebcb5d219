"""A model as functions the train step runs, whatever it was written in.

fns        `ModelFns` and the adapters that make one (`from_nnx`, `from_linen`, pytrees)
nnx_split  an NNX module split into graph definition, params and the rest (`NnxSplit`)
lora       `with_lora`: LoRA adapters on any model's matrix products, in the factored form (`LoraModel`)
variables  the model's non-trainable variables and per-step randomness through the step
flax_import flax imported without IPython outside IPython (a faster start-up; imported first)
"""

from fsdp_jax.model import flax_import  # noqa: F401  (first: before anything imports flax)
from fsdp_jax.model.fns import ModelFns, from_linen, from_nnx
from fsdp_jax.model.lora import LoraModel, with_lora

__all__ = ["LoraModel", "ModelFns", "from_linen", "from_nnx", "with_lora"]
