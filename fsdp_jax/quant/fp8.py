"""Scaled FP8 matmuls with per-tensor scales: e4m3 forward operands, e5m2 gradients, f32
accumulation (docs/fp8.md).

`scaled_matmul(x, w, sx, sw)` is, in the forward pass,

    xq = clip(x * sx, -448, 448) as float8_e4m3fn     (sx: float32 scalar, 448 / amax)
    wq = clip(w * sw, -448, 448) as float8_e4m3fn
    y  = (dot(xq, wq) accumulated in float32, written in x's dtype) * (1 / (sx * sw)), in x's dtype

(the GEMM writes the compute dtype, as cuBLASLt's FP8 GEMMs write a bf16 D: written in float32,
the output a `dots` remat policy saves doubled, +40.8 GB per H100 on Llama-3.1-8B, docs/fp8.md)

and in the backward pass the output gradient g is scaled by its own current amax
(`57344 / amax(g)`), cast to float8_e5m2 (the wider range, as gradients need), and
multiplied in f8 against the saved e4m3 operands (e4m3 x e5m2, the pairs Hopper's FP8
tensor cores take), again accumulated in float32:

    dx = dot(gq, wq^T) / (sg * sw),   dw = dot(xq^T, gq) / (sx * sg)

The weight gradient leaves in the reduce dtype behind an optimization barrier when the
step reduces in a wider dtype than the weight's (as `fsdp_jax.sharding.precision.matmul`).
Master weights and optimizer state never see f8: only the matmul's operands are cast.

Where `sx`, `sw` come from is the recipe's (`RECIPES`, torchtitan's / Transformer Engine's
names): `tensorwise` scales by the current amax of each operand; `delayed` by the
largest amax of the last `amax_history` steps (the operand's own history, stored in the
train state), pushing the current amax after use. A history of zeros (the first step)
scales by the current amax. `tensorwise` scales gradients by their current amax; `delayed`
passes the output gradient's history in (`grad_history`): the backward scales g by that
history's max and returns the history with amax(g) pushed as the history's cotangent, which
the train step keeps as the new history (`fsdp_jax.model.variables.FROM_GRADIENT`; Flax's
`fp8_ops.out_qdq` with `output_grad_amax_history` in `OVERWRITE_WITH_GRADIENT`).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

from fsdp_jax.quant.recipes import RECIPES
from fsdp_jax.sharding.mesh import constrain
from fsdp_jax.train.layer_gather import GATHERED  # the gathered f8 weight: never saved under ZeRO-3

E4M3 = jnp.dtype(jnp.float8_e4m3fn)  # forward operands: 448 max, 3 mantissa bits
E5M2 = jnp.dtype(jnp.float8_e5m2)  # gradients: 57344 max, 2 mantissa bits


# Where FP8 matmuls run natively (data, with sources): NVIDIA GPUs of compute capability >= 8.9
# (Ada 8.9, Hopper 9.0, Blackwell 10.x: CUDA C++ Programming Guide, "Compute Capabilities",
# FP8 tensor core rows; the H100 datasheet's FP8 column), not A100 (8.0); TPUs before Ironwood
# (v7) have no FP8 MXU mode (Cloud TPU docs, system architecture: v4 / v5e / v5p / v6e MXUs
# take bf16 and int8).
FP8_MIN_COMPUTE_CAPABILITY = (8, 9)
FP8_GPU_KINDS = {"h100": True, "h200": True, "h800": True, "l4": True, "l40": True, "b200": True, "a100": False}
FP8_TPU_KINDS = ("v7", "ironwood")


def device_problem(platform: str, kind: str, compute_capability=None, emulate: bool = False) -> str | None:
    """None when FP8 matmuls may run on a device of `platform` ("cpu", "gpu"/"cuda", "tpu")
    and `kind` (the device kind, or a target name such as "h100"); else the one line saying
    why not. CPU needs `emulate` (numerics only: XLA:CPU upcasts f8 dots); a GPU needs FP8
    tensor cores (`compute_capability` "9.0", else a known `kind`); a TPU needs v7."""
    kind_l = str(kind).lower()
    if platform == "cpu":
        return None if emulate else "FP8 on CPU is emulation only (no FP8 units): set fp8.emulate=true to run it"
    if platform == "tpu":
        ok = any(k in kind_l for k in FP8_TPU_KINDS)
        return None if ok else f"TPU {kind} has no FP8 matmul units (TPU v7 and later); use matmul=compute"
    if compute_capability:
        cc = tuple(int(p) for p in str(compute_capability).split(".")[:2])
        ok = cc >= FP8_MIN_COMPUTE_CAPABILITY
    else:
        ok = next((v for k, v in FP8_GPU_KINDS.items() if k in kind_l), False)
    if ok:
        return None
    return f"GPU {kind} has no FP8 tensor cores (compute capability >= 8.9: H100, H200, L4, B200); use matmul=compute"


@dataclasses.dataclass(frozen=True)
class Fp8Recipe:
    """How projections compute in FP8: `name` a key of `RECIPES`; `amax_history` the
    steps a delayed recipe remembers (>= 1); `gather`: under full_shard, weights are cast
    to f8 in their sharded layout so the per-layer all-gathers move f8 (torchtitan's
    enable_fsdp_float8_all_gather). ValueError (one line) on a bad field."""

    name: str = "tensorwise"
    amax_history: int = 16
    gather: bool = True

    def __post_init__(self):
        if self.name not in RECIPES:
            raise ValueError(f"unknown fp8 recipe {self.name!r}; choose one of {', '.join(RECIPES)}")
        if not isinstance(self.amax_history, int) or self.amax_history < 1:
            raise ValueError(f"fp8 amax_history must be an integer >= 1, got {self.amax_history!r}")

    @property
    def delayed(self) -> bool:
        return self.name == "delayed"

    @property
    def rowwise(self) -> bool:
        return self.name == "rowwise"


def fp8_max(dtype) -> float:
    return float(jnp.finfo(dtype).max)


def amax(x) -> jax.Array:
    """max |x| over the whole tensor, float32 scalar, no gradient."""
    return jax.lax.stop_gradient(jnp.max(jnp.abs(x)).astype(jnp.float32))


def scale_for(a, dtype) -> jax.Array:
    """The per-tensor scale mapping amax `a` onto `dtype`'s largest finite value (float32);
    1 where `a` is 0 or not finite (nothing to scale, or a step the guard will skip)."""
    a = jnp.asarray(a, jnp.float32)
    ok = (a > 0) & jnp.isfinite(a)
    return jnp.where(ok, fp8_max(dtype) / jnp.where(ok, a, 1.0), 1.0).astype(jnp.float32)


def quantize(x, scale, dtype) -> jax.Array:
    """`x * scale` clipped to `dtype`'s finite range (no inf, no NaN from overflow), in `dtype`."""
    m = fp8_max(dtype)
    return jnp.clip(x.astype(jnp.float32) * scale, -m, m).astype(dtype)


def push(history, a) -> jax.Array:
    """`history` (L,) with `a` in front (newest first), the oldest entry dropped."""
    return jnp.roll(history, 1).at[0].set(jnp.asarray(a, history.dtype))


def history_scale(history, current, dtype) -> jax.Array:
    """The delayed scale: from max(`history`), or from `current` while the history is all
    zeros (the first step)."""
    ref = jnp.max(history)
    return scale_for(jnp.where(ref > 0, ref, current), dtype)


def f8_dot(a, b, contract: tuple[tuple[int, ...], tuple[int, ...]], out=jnp.float32) -> jax.Array:
    """dot_general of two f8 operands accumulated in float32, returned in `out`."""
    return jax.lax.dot_general(a, b, (contract, ((), ())), preferred_element_type=out)


def scaled_matmul(x, w, sx, sw, *, reduce_dtype=None, layouts=None, grad_history=None) -> jax.Array:
    """`x @ w` (x (..., K), w 2-D (K, N)) through FP8 as the module docstring writes it;
    `sx`, `sw` float32 scalars (`scale_for`). `reduce_dtype`: the weight gradient's (None:
    w's). `layouts`: (at rest, gathered) NamedShardings of `w` (any rank) and the 2-D shape
    it is used in, so the cast runs on the shards and the gather moves f8
    (`Fp8Recipe.gather`); None: `w` is 2-D, no layout asked. `grad_history`: None (the
    gradient scaled by its current amax), or the output gradient's (L,) float32 amax
    history: g is scaled by `history_scale(grad_history, amax(g))` and the history's
    cotangent is `push(grad_history, amax(g))`, the new history (delayed recipe)."""
    r = jnp.dtype(reduce_dtype if reduce_dtype is not None else w.dtype)
    sx, sw = jnp.asarray(sx, jnp.float32), jnp.asarray(sw, jnp.float32)
    if grad_history is None:
        return _make(r, layouts)(x, w, sx, sw)
    return _make_delayed_grad(r, layouts)(x, w, sx, sw, jnp.asarray(grad_history, jnp.float32))


def cast_weight(w, sw, layouts=None) -> jax.Array:
    """`w` as the forward's e4m3 operand: with `layouts` = (rest, full, shape2d), cast in
    its at-rest layout and left there (`gather_weight` gathers it); else cast as it is."""
    if layouts is None:
        return quantize(w, sw, E4M3)
    rest, _, _ = layouts
    # the f8 value itself pinned to the shards: with only its input pinned, the partitioner
    # gathered the cast's f32 intermediate (measured, XLA:CPU and Shardy)
    return constrain(quantize(constrain(w, rest), sw, E4M3), rest)


def gather_weight(wq, layouts=None) -> jax.Array:
    """A `cast_weight` result laid out for the matmul, 2-D: the f8 shards all-gathered
    (named GATHERED, so no remat policy keeps the gathered copy)."""
    if layouts is None:
        return wq
    _, full, shape2d = layouts
    return checkpoint_name(constrain(wq, full), GATHERED).reshape(shape2d)


def _forward(layouts, x, w, sx, sw):
    """(y, residuals) of the scaled matmul's forward pass."""
    xq = quantize(x, sx, E4M3)
    wq = cast_weight(w, sw, layouts)  # at rest (sharded) under full_shard
    y = f8_dot(xq, gather_weight(wq, layouts), ((x.ndim - 1,), (0,)), x.dtype) * (1.0 / (sx * sw))
    # the f8 weight is kept as its shards and gathered again in the backward (ZeRO-3)
    res = (xq, wq, sx, sw, jnp.zeros((0,) + w.shape, w.dtype), jnp.zeros((0,), x.dtype))
    return y.astype(x.dtype), res


def _backward(reduce_dtype, layouts, res, g, sg):
    """(dx, dw) from the forward's residuals and the output gradient `g` scaled by `sg` onto e5m2."""
    xq, wq, sx, sw, w_like, x_like = res
    wq = gather_weight(wq, layouts)
    gq = quantize(g, sg, E5M2)
    dx = (f8_dot(gq, wq, ((g.ndim - 1,), (1,))) * (1.0 / (sg * sw))).astype(x_like.dtype)
    lead = tuple(range(xq.ndim - 1))
    dw = f8_dot(xq, gq, (lead, lead)) * (1.0 / (sx * sg))
    if reduce_dtype.itemsize > w_like.dtype.itemsize:  # reduced across devices in the wider dtype
        dw = jax.lax.optimization_barrier(dw.astype(reduce_dtype))
    return dx, dw.astype(w_like.dtype).reshape(w_like.shape[1:])


@functools.lru_cache(maxsize=None)
def _make(reduce_dtype, layouts):
    @jax.custom_vjp
    def fp8_matmul(x, w, sx, sw):
        return _forward(layouts, x, w, sx, sw)[0]

    def fwd(x, w, sx, sw):
        return _forward(layouts, x, w, sx, sw)

    def bwd(res, g):
        sx, sw = res[2], res[3]
        dx, dw = _backward(reduce_dtype, layouts, res, g, scale_for(amax(g), E5M2))
        return dx, dw, jnp.zeros_like(sx), jnp.zeros_like(sw)

    fp8_matmul.defvjp(fwd, bwd)
    return fp8_matmul


@functools.lru_cache(maxsize=None)
def _make_delayed_grad(reduce_dtype, layouts):
    """`_make`'s matmul taking the output gradient's amax history as a fifth operand, whose
    cotangent is the history with this gradient's amax pushed (as Flax's `out_qdq_bwd`
    returns `new_history`): the step keeps that cotangent as the new history."""

    @jax.custom_vjp
    def fp8_matmul(x, w, sx, sw, gh):
        return _forward(layouts, x, w, sx, sw)[0]

    def fwd(x, w, sx, sw, gh):
        y, res = _forward(layouts, x, w, sx, sw)
        return y, (res, gh)

    def bwd(res_gh, g):
        res, gh = res_gh
        ag = amax(g)
        dx, dw = _backward(reduce_dtype, layouts, res, g, history_scale(gh, ag, E5M2))
        return dx, dw, jnp.zeros_like(res[2]), jnp.zeros_like(res[3]), push(gh, ag)

    fp8_matmul.defvjp(fwd, bwd)
    return fp8_matmul
