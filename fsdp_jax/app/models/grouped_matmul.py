"""The dropless experts' grouped matmul: rows grouped by expert, each group times its expert.

    y = grouped_matmul(x, w, sizes, "auto")   # x (M, K), w (G, K, N), sizes (G,) int32 -> (M, N)

Implementations (`model.grouped_matmul`):
- `xla`: `jax.lax.ragged_dot`. XLA:TPU lowers it to its grouped matmul; XLA:CPU and XLA:GPU
  (jax 0.10 and 0.12, measured: `benchmarks/ragged_dot_lowering.py`) expand it into one dense
  dot of every row against every group, masked: n_groups times the grouped FLOPs. XLA:GPU's
  cuDNN grouped GEMM (`--xla_gpu_experimental_use_ragged_dot_fusion`) needs cuDNN >= 9.22 and
  a device at compile time (docs/moe.md, "Grouped matmul on GPU").
- `tokamax`: tokamax's `ragged_dot` (`pip install tokamax`): Pallas kernels that compute the
  groups only, forward and backward (Mosaic GPU on sm90, else Triton). GPU only.
- `auto` (the default): `tokamax` when the default device is a GPU and tokamax imports, else
  `xla`. The planner's GPU-target compiles lower with the target's device as the default
  (`planner/abstract_step.StepBuild.compile`), so they see what a GPU run would run.

Rows past sum(sizes) (the experts of other devices, empty exchange rows) belong to no group
and come out 0 with every implementation.
"""

from __future__ import annotations

import importlib.util

import jax
import jax.numpy as jnp

from fsdp_jax.errors import ConfigError

GROUPED_MATMULS = ("auto", "xla", "tokamax")
TOKAMAX_KERNELS = ("mosaic", "triton")  # tried in this order; tokamax skips one the device lacks


def lowering_platform() -> str:
    dev = jax.config.jax_default_device
    if isinstance(dev, str):  # a platform name
        return dev
    return (dev or jax.devices()[0]).platform


def resolve(impl: str) -> str:
    """`impl` with `auto` replaced by what runs here (module docstring)."""
    if impl not in GROUPED_MATMULS:
        raise ConfigError("model.grouped_matmul", f"{impl!r} is not one of {', '.join(GROUPED_MATMULS)}")
    platform = lowering_platform()
    gpu, have = platform in ("gpu", "cuda"), importlib.util.find_spec("tokamax") is not None
    if impl == "tokamax" and not (gpu and have):
        why = f"it runs on GPU only (this step is lowered for {platform})" if have else "pip install tokamax"
        raise ConfigError("model.grouped_matmul", f"tokamax: {why}")
    if impl != "auto":
        return impl
    return "tokamax" if gpu and have else "xla"


def grouped_matmul(x, w, sizes, impl: str = "auto"):
    """x (M, K) rows sorted by group, w (G, K, N), sizes (G,) int32 with sum <= M -> (M, N) in
    x's dtype: row i of group g is x[i] @ w[g]; rows past sum(sizes) are 0."""
    if resolve(impl) == "xla":
        return jax.lax.ragged_dot(x, w, sizes)
    y = _tokamax(x, w, sizes)
    # the kernels need not write the rows outside every group
    rows = jnp.arange(x.shape[0], dtype=jnp.int32) < jnp.sum(sizes)
    return jnp.where(rows[:, None], y, jnp.zeros((), y.dtype))


# x (M, K), dy (M, N) -> dw (G, K, N): contracted over the rows, one sum per group
_DW_DIMS = jax.lax.RaggedDotDimensionNumbers(
    dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=(0,), rhs_group_dimensions=()
)


def _like(y, ref):
    """`y` typed over the manual mesh axes (inside a shard_map) as `ref` is: marked varying
    over the axes `ref` varies over (the Pallas kernels' results carry no such type, and a
    custom VJP's must match its inputs'), summed over those it varies over and `ref` does not
    (the gradient of a weight every shard shares: what the transpose of XLA's implicit
    broadcast of it would sum)."""
    extra = tuple(sorted(_varying(y) - _varying(ref)))
    y = jax.lax.psum(y, extra) if extra else y
    missing = tuple(sorted(_varying(ref) - _varying(y)))
    return jax.lax.pcast(y, missing, to="varying") if missing else y


def _varying(a) -> set[str]:
    t = jax.typeof(a)
    mat = getattr(t, "manual_axis_type", None)  # jax 0.10; earlier releases: `vma`
    return set(mat.varying if mat is not None else getattr(t, "vma", ()))


def _kernel(x, w, sizes):
    import tokamax

    return _like(tokamax.ragged_dot(x, w, sizes, implementation=TOKAMAX_KERNELS), x)


@jax.custom_vjp
def _tokamax(x, w, sizes):
    return _kernel(x, w, sizes)


def _tokamax_fwd(x, w, sizes):
    return _kernel(x, w, sizes), (x, w, sizes)


def _tokamax_bwd(res, dy):
    import tokamax

    x, w, sizes = res
    dx = _kernel(dy, jnp.swapaxes(w, 1, 2), sizes)
    dw = tokamax.ragged_dot_general(x, dy, sizes, _DW_DIMS, implementation=TOKAMAX_KERNELS)
    return _like(dx.astype(x.dtype), x), _like(dw.astype(w.dtype), w), None


_tokamax.defvjp(_tokamax_fwd, _tokamax_bwd)
