"""How XLA:GPU (a deviceless H100 compile) lowers `jax.lax.ragged_dot`: the grouped matmul of
the dropless MoE layer, against the dense all-experts einsum. Prints each program's dot /
GEMM ops with their result shapes and the FLOPs they imply.

    python benchmarks/ragged_dot_lowering.py [--tokens 8192] [--d 1024] [--f 2048] [--experts 8]

Needs the compile-only CUDA plugin (`python -m fsdp_jax.targets install cuda`); runs itself
again in a child process with the plugin's environment.
"""

import argparse
import math
import os
import re
import subprocess
import sys


def child(tokens: int, d: int, f: int, experts: int) -> None:
    from fsdp_jax.targets import gpu

    gpu.enable_in_process()
    import jax
    import jax.numpy as jnp
    from jax.sharding import SingleDeviceSharding

    sh = SingleDeviceSharding(gpu.gpu_devices("h100", 1, 1)[0])
    spec = lambda *s, dt=jnp.bfloat16: jax.ShapeDtypeStruct(s, dt, sharding=sh)  # noqa: E731
    programs = {
        "ragged_dot": jax.jit(jax.lax.ragged_dot).lower(
            spec(tokens, d), spec(experts, d, f), spec(experts, dt=jnp.int32)
        ),
        "dense einsum": jax.jit(lambda x, w: jnp.einsum("td,edf->tef", x, w)).lower(
            spec(tokens, d), spec(experts, d, f)
        ),
    }
    print(f"jax {jax.__version__}; grouped FLOPs 2 T D F = {2 * tokens * d * f:.3e}")
    for name, lowered in programs.items():
        text = lowered.compile().as_text()
        shapes = {
            m.group(1): [int(x) for x in m.group(2).split(",")]
            for m in re.finditer(r"%([\w.\-]+) = \w+\[([\d,]+)\]", text)
        }
        for m in re.finditer(
            r"%([\w.\-]+) = \w+\[([\d,]+)\]\S* fusion\(%([\w.\-]+), %([\w.\-]+)\), kind=kCustom, calls=%[\w.]*gemm",
            text,
        ):
            out, lhs, rhs = [int(x) for x in m.group(2).split(",")], shapes[m.group(3)], shapes[m.group(4)]
            k = math.isqrt(math.prod(lhs) * math.prod(rhs) // math.prod(out))  # the contracted size
            flops = 2 * math.prod(out) * k
            print(
                f"{name}: GEMM {lhs} x {rhs} -> {out}: {flops:.3e} FLOPs ({flops / (2 * tokens * d * f):.1f}x grouped)"
            )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for flag, default in (("--tokens", 8192), ("--d", 1024), ("--f", 2048), ("--experts", 8)):
        ap.add_argument(flag, type=int, default=default)
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if min(args.tokens, args.d, args.f, args.experts) < 1:
        ap.error("--tokens, --d, --f and --experts must be positive")
    if args.child:
        child(args.tokens, args.d, args.f, args.experts)
        return 0
    from fsdp_jax.targets import gpu

    env = gpu.child_env(dict(os.environ))
    extra = sys.argv[1:] if argv is None else list(argv)
    return subprocess.run([sys.executable, __file__, *extra, "--child"], env=env).returncode


if __name__ == "__main__":
    sys.exit(main())
