"""QLoRA on the reference decoder: which of its weights a quantised base quantises and how
(`LoraSpec.base_quant`, the run config's `lora.base_quant`), and the line refusing a model
it cannot quantise. The quantisation itself is the library's (`fsdp_jax.quant`)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from fsdp_jax.app.models.lora import LoraSpec, adapted, weight_dims
from fsdp_jax.quant.weight import dequantize, quantize

# how many leading dims of each weight its product contracts (int8's per-output-channel absmax)
CONTRACTED = {"wq": 1, "wk": 1, "wv": 1, "wo": 2, "w_gate": 1, "w_up": 1, "w_down": 1}


def quant_problem(cfg, spec: LoraSpec) -> str | None:
    """None, or the line refusing `spec.base_quant` on model `cfg`: routed experts (not
    quantised yet), a target whose last dim a block does not divide or is smaller than one."""
    if spec.base_quant is None:
        return None
    if cfg.n_experts:
        return "a quantised base is for dense models (routed experts are not quantised yet)"
    for name in adapted(cfg, spec)[0]:
        _, _, out_shape, _ = weight_dims(cfg, name)
        shape = weight_dims(cfg, name)[0] + out_shape
        problem = spec.base_quant.problem(name, shape)
        if problem:
            return problem
    return None


def as_trained(path: str, leaf: np.ndarray, cfg, spec: LoraSpec) -> np.ndarray:
    """A base weight as a QLoRA run computed with it: quantised as the run quantised it (the
    same JAX quantiser) and dequantised in float32; `leaf` itself when the run left it as it
    is (no base_quant, or not one of the quantised targets)."""
    name = path.rsplit("/", 1)[-1]
    if spec.base_quant is None or name not in adapted(cfg, spec)[0] or name not in CONTRACTED:
        return leaf
    depth = 1 if cfg.scan_layers else 0
    q = jax.jit(lambda w: quantize(jnp, w, spec.base_quant, depth, CONTRACTED[name]))(leaf.astype(np.float32))
    return dequantize(np, {k: np.asarray(v) for k, v in q.items()}, spec.base_quant, np.float32)
