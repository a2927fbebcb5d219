#!/usr/bin/env python
"""Deviceless XLA:GPU compile of the model's cuDNN attention on packed rows (segment ids).

    PYTHONPATH=.:~/.cache/fsdp_jax/cuda12-plugin-0.10.2:/tmp/cudnn python benchmarks/cudnn_packed_compile.py

Needs the compile-only CUDA plugin (`python -m fsdp_jax.targets install`) and NVIDIA's
cuDNN, cuBLAS and NVRTC wheels (`pip install --target DIR nvidia-cudnn-cu12
nvidia-cublas-cu12 nvidia-cuda-nvrtc-cu12`), both on PYTHONPATH before jax is imported:
jax asks the cuDNN library for its version while tracing. Compiles forward and backward of
`fsdp_jax.app.models.decoder.attention(q, k, v, segment_ids, "cudnn")` (bf16, GQA) for an
H100 and prints whether the cuDNN fused-attention custom call is in the program.
It cannot run the kernel; that needs a GPU.
"""

import os
import sys

os.environ["JAX_PLATFORMS"] = "cpu"


def main() -> int:
    import jax
    import jax._src.cudnn.fused_attention_stablehlo as fa
    import jax.numpy as jnp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    from fsdp_jax.app.models.attention import attention
    from fsdp_jax.targets import gpu

    # jax asks the *default* backend (CPU here) for the compute capability; the target
    # is an H100 (sm_90), so answer for it
    fa.check_compute_capability = lambda c: tuple(int(x) for x in c.split(".")) <= (9, 0)

    dev = gpu.gpu_devices("h100", 1, 1)
    mesh = jax.sharding.Mesh(dev, ("d",))
    rep = NamedSharding(mesh, P())
    b, s, h, kv, dh = 2, 256, 8, 2, 64

    def loss(q, k, v, seg):
        return attention(q, k, v, seg, "cudnn").astype(jnp.float32).sum()

    args = (
        jax.ShapeDtypeStruct((b, s, h, dh), jnp.bfloat16, sharding=rep),
        jax.ShapeDtypeStruct((b, s, kv, dh), jnp.bfloat16, sharding=rep),
        jax.ShapeDtypeStruct((b, s, kv, dh), jnp.bfloat16, sharding=rep),
        jax.ShapeDtypeStruct((b, s), jnp.int32, sharding=rep),
    )
    compiled = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(*args).compile()
    text = compiled.as_text()
    calls = sorted(
        {
            line.split('custom_call_target="')[1].split('"')[0]
            for line in text.splitlines()
            if 'custom_call_target="__cudnn' in line
        }
    )
    print(f"compiled for {dev[0].device_kind}: cuDNN custom calls {calls}")
    return 0 if any("fmha" in c.lower() for c in calls) else 1


if __name__ == "__main__":
    sys.exit(main())
