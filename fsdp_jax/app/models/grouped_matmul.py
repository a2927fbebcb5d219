"""The dropless experts' grouped matmul: rows grouped by expert, each group times its expert.

    y = grouped_matmul(x, w, sizes, "auto")   # x (M, K), w (G, K, N), sizes (G,) int32 -> (M, N)

Implementations (`model.grouped_matmul`):
- `xla`: `jax.lax.ragged_dot`. XLA:TPU lowers its forward and input gradient to grouped
  kernels and its weight gradient to a masked dense product over every group (libtpu 0.0.42.1,
  docs/moe.md); XLA:CPU and XLA:GPU (jax 0.10 and 0.12, measured:
  `benchmarks/ragged_dot_lowering.py`) expand it into one dense dot of every row against every
  group, masked: n_groups times the grouped FLOPs. XLA:GPU's cuDNN grouped GEMM
  (`--xla_gpu_experimental_use_ragged_dot_fusion`) needs cuDNN >= 9.22 and a device at compile
  time (docs/moe.md, "Grouped matmul on GPU and TPU").
- `tokamax`: tokamax's `ragged_dot` (`pip install tokamax`): Pallas kernels that compute the
  groups only, forward and both backward products (their `ragged_dot_general` for the weight
  gradient). GPU: Mosaic GPU on sm90 (bf16 / f16 operands only), else Triton. TPU v5 and later: Mosaic TPU (megablox's
  `gmm` / `tgmm`), which takes rows, contracted and output dims in whole tiles of 128
  (`TPU_TILE`; tokamax 0.0.12 and 0.0.17 raise on fewer than 128 rows or columns and on rows
  not divisible by the tile; other dims fail to trace). Elsewhere, or a TPU product it cannot
  take: one line naming `model.grouped_matmul`.
- `auto` (the default): `tokamax` when tokamax imports and the step is lowered for a GPU, or
  for a TPU v5+ and this product's dims fit the TPU kernel; else `xla` (so on TPU a LoRA
  adapter's rank-r product under 128 stays on XLA's `ragged_dot`, and so on a GPU does a product
  of f32 operands where this tokamax has only its Mosaic GPU kernel). The planner's compiles
  lower with the target's device as the default (`planner/abstract_step.StepBuild.compile`),
  so they see what a run on the target would run.

Rows past sum(sizes) (the experts of other devices, empty exchange rows) belong to no group
and come out 0 with every implementation.
"""

from __future__ import annotations

import contextlib
import importlib.util
import re

import jax
import jax.numpy as jnp
from jax._src import config as jax_config

from fsdp_jax.app.models.choices import GROUPED_MATMULS
from fsdp_jax.errors import ConfigError

TPU_TILE = 128  # tokamax's Mosaic TPU kernel: its default tile (pallas_mosaic_tpu.Config) and smallest dim


def lowering_platform() -> str:
    dev = jax.config.jax_default_device
    if isinstance(dev, str):  # a platform name
        return dev
    return (dev or jax.devices()[0]).platform


def _tpu_generation() -> int:
    """The default TPU device's generation from its kind ("TPU v5", "TPU v6 lite"), 0 if unknown."""
    dev = jax.config.jax_default_device
    kind = "" if isinstance(dev, str) else (dev or jax.devices()[0]).device_kind
    m = re.search(r"v(\d+)", kind)
    return int(m.group(1)) if m else 0


def tpu_misfit(m: int, k: int, n: int) -> str | None:
    """Why tokamax's Mosaic TPU kernel cannot take an (m, k) x (G, k, n) grouped product, or None."""
    bad = [f"{what} {v}" for what, v in (("rows", m), ("contracted", k), ("output", n)) if v < TPU_TILE or v % TPU_TILE]
    return f"{', '.join(bad)} not a multiple of {TPU_TILE}" if bad else None


def resolve(
    impl: str, dims: tuple[int, int, int] | None = None, platform: str | None = None, generation: int = 0
) -> str:
    """`impl` with `auto` replaced by what runs here (module docstring) for a grouped product of
    `dims` (m, k, n) (None: whichever product); `platform` ("gpu", "tpu", "cpu") and a TPU's
    `generation` name where the step is lowered for (a planning target), None: this process's
    lowering device."""
    if impl not in GROUPED_MATMULS:
        raise ConfigError("model.grouped_matmul", f"{impl!r} is not one of {', '.join(GROUPED_MATMULS)}")
    if impl == "xla":
        return impl
    if platform is None:
        platform = lowering_platform()
        generation = _tpu_generation() if platform == "tpu" else 0
    have = importlib.util.find_spec("tokamax") is not None
    gpu, tpu = platform in ("gpu", "cuda"), platform == "tpu" and generation >= 5
    misfit = tpu_misfit(*dims) if tpu and dims else None
    if impl == "tokamax":
        if not have:
            raise ConfigError("model.grouped_matmul", "tokamax: pip install tokamax")
        if not (gpu or tpu):
            where = "TPU v4" if platform == "tpu" else platform
            raise ConfigError(
                "model.grouped_matmul", f"tokamax runs on GPU and TPU v5+ only (this step is for {where})"
            )
        if misfit:
            raise ConfigError(
                "model.grouped_matmul",
                f"tokamax's TPU kernel needs dims in multiples of {TPU_TILE}; a grouped product of "
                f"({dims[0]}, {dims[1]}) x (experts, {dims[1]}, {dims[2]}) has {misfit} (use auto or xla)",
            )
        return impl
    return "tokamax" if have and (gpu or (tpu and not misfit)) else "xla"


def _kernels(x, y) -> tuple[str, ...]:
    """tokamax's implementations to try for a product of `x` and `y` (2-D rows and the groups'
    matrices or the other rows), in order (tokamax skips one the device lacks): on TPU Mosaic
    TPU ("mosaic" is the device's Mosaic); on GPU Mosaic GPU then Triton, or Triton first when
    a contracted or output dim is under `TPU_TILE` (a LoRA adapter's rank: Mosaic GPU's sm90
    kernel fails to lower a rank-16 product, "WGMMA rhs swizzle must match lhs swizzle",
    tokamax 0.0.12, measured) and this tokamax has it (0.0.17's needs `jax_triton`)."""
    if lowering_platform() == "tpu":
        return ("mosaic",)
    if min(x.shape[1], y.shape[-1]) < TPU_TILE and "triton" in _tokamax_implementations():
        return ("triton",)
    return ("mosaic", "triton") if "triton" in _tokamax_implementations() else ("mosaic",)


def _tokamax_implementations() -> tuple[str, ...]:
    try:
        from tokamax._src.ops.ragged_dot import api  # private: the implementations that imported
    except ImportError:  # another layout: let tokamax choose among ours
        return ()
    return tuple(getattr(api, "IMPLEMENTATIONS", ()))


# the operand dtypes tokamax's Mosaic GPU kernel takes (0.0.17: "Only bfloat16/float16 inputs
# are supported"); its Triton kernel takes any, where this tokamax has it (0.0.17's needs jax_triton)
MOSAIC_GPU_DTYPES = ("bfloat16", "float16")


def gpu_misfit(dtype) -> str | None:
    """Why this tokamax has no GPU kernel for `dtype` operands, or None."""
    if jnp.dtype(dtype).name in MOSAIC_GPU_DTYPES or "triton" in _tokamax_implementations():
        return None
    return f"tokamax's Mosaic GPU kernel takes {' or '.join(MOSAIC_GPU_DTYPES)} operands, not {jnp.dtype(dtype).name}"


def grouped_matmul(x, w, sizes, impl: str = "auto"):
    """x (M, K) rows sorted by group, w (G, K, N), sizes (G,) int32 with sum <= M -> (M, N) in
    x's dtype: row i of group g is x[i] @ w[g]; rows past sum(sizes) are 0. On a GPU whose
    tokamax has no kernel for x's dtype (`gpu_misfit`), `auto` is XLA's and `tokamax` refused."""
    chosen = resolve(impl, (x.shape[0], x.shape[1], w.shape[2]))
    misfit = gpu_misfit(x.dtype) if chosen == "tokamax" and lowering_platform() in ("gpu", "cuda") else None
    if misfit and impl == "tokamax":
        raise ConfigError("model.grouped_matmul", f"{misfit} (use auto or xla, or compute=bfloat16)")
    if chosen == "xla" or misfit:
        return jax.lax.ragged_dot(x, w, sizes)
    return _tokamax(x, w, sizes)


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


# From which jax a platform's tokamax kernels are traced with the manual-axis check on. jax 0.12
# lowers a traced step's kernels once more with the check on, whatever the context they were
# traced in: a kernel traced without it (no `pvary` put in where a varying and an unvarying
# operand meet) then fails there ("Primitive max requires varying manual axes to match": tokamax
# 0.0.17's Mosaic GPU kernel on 8 x H100 under FP8, tests/test_fp8_tokamax_experts.py), and traced
# with it that kernel's results carry their type. Its Mosaic TPU kernel's results still carry
# none on jax 0.12 (tests/test_grouped_matmul.py's TPU cases), nor any kernel's on jax 0.10.
TRACE_CHECKED_FROM = {"gpu": (0, 12)}


def _unchecked():
    """On an accelerator, a context in which a Pallas call may leave its result's manual-axis
    type unset: tokamax 0.0.12's Mosaic TPU kernel and its Pallas Triton GPU kernel give none,
    which jax 0.10 refuses inside a `shard_map` that checks them ("`manual_axis_type` on
    `jax.ShapeDtypeStruct` must not be `None`": the dropless experts' dispatch on 8 x H100).
    Its result is typed by `_like` instead. jax's own switch, private: the one `shard_map(...,
    check_vma=False)` sets. On CPU (interpreted kernels) the check stays on, and on a platform
    from the jax `TRACE_CHECKED_FROM` names."""
    platform = lowering_platform()
    if platform == "cpu" or jax.__version_info__ >= TRACE_CHECKED_FROM.get(platform, (1 << 30,)):
        return contextlib.nullcontext()

    return jax_config._check_vma(False)


def _kernel(x, w, sizes):
    import tokamax

    with _unchecked():
        y = tokamax.ragged_dot(x, w, sizes, implementation=_kernels(x, w))
    # the kernels need not write the rows outside every group (interpreted, the TPU kernel
    # leaves them NaN): 0, as XLA's ragged_dot gives them, forward and for the input gradient
    rows = jnp.arange(x.shape[0], dtype=jnp.int32) < jnp.sum(sizes)
    return _like(jnp.where(rows[:, None], y, jnp.zeros((), y.dtype)), x)


@jax.custom_vjp
def _tokamax(x, w, sizes):
    return _kernel(x, w, sizes)


def _tokamax_fwd(x, w, sizes):
    return _kernel(x, w, sizes), (x, w, sizes)


def _tokamax_bwd(res, dy):
    import tokamax

    x, w, sizes = res
    dx = _kernel(dy, jnp.swapaxes(w, 1, 2), sizes)
    with _unchecked():
        dw = tokamax.ragged_dot_general(x, dy, sizes, _DW_DIMS, implementation=_kernels(x, dy))
    # dw sums over rows that vary as x and dy do: mark it so (a kernel's result may carry no
    # type), then `_like` sums it over the shards that share w
    dw = _varying_over(dw.astype(w.dtype), _varying(x) | _varying(dy))
    return _like(dx.astype(x.dtype), x), _like(dw, w), None


def _varying_over(y, axes: set[str]):
    missing = tuple(sorted(axes - _varying(y)))
    return jax.lax.pcast(y, missing, to="varying") if missing else y


_tokamax.defvjp(_tokamax_fwd, _tokamax_bwd)
