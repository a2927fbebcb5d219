"""The dropless experts' grouped matmul (`fsdp_jax/app/models/grouped_matmul.py`) and how a
compiled program's grouped-GEMM kernels are costed (`fsdp_jax/hlo/grouped.py`). The tokamax
kernels themselves compile for a GPU target in tests/test_moe_flops.py (no GPU runs here)."""

import importlib
import importlib.util

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fsdp_jax.app.models.grouped_matmul import grouped_matmul, resolve
from fsdp_jax.errors import ConfigError
from fsdp_jax.hlo.grouped import grouped_gemm


def test_xla_grouped_matmul_is_each_group_times_its_matrix_and_zero_past_the_groups():
    rng = np.random.default_rng(0)
    m, k, n, sizes = 13, 6, 5, np.array([3, 0, 4, 2], np.int32)  # 9 of 13 rows in groups
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((len(sizes), k, n)).astype(np.float32)
    want = np.zeros((m, n), np.float32)
    start = 0
    for g, s in enumerate(sizes):  # by hand, group by group
        want[start : start + s] = x[start : start + s] @ w[g]
        start += s
    got = np.asarray(jax.jit(lambda x, w, s: grouped_matmul(x, w, s, "xla"))(x, w, jnp.asarray(sizes)))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert not got[9:].any()


def test_auto_is_xla_on_cpu_and_tokamax_or_a_bad_name_is_refused_there():
    assert jax.devices()[0].platform == "cpu"
    assert resolve("auto") == "xla" and resolve("xla") == "xla"
    for impl in ("tokamax", "cutlass"):
        with pytest.raises(ConfigError, match=r"^model\.grouped_matmul: "):
            resolve(impl)


_META = 'metadata={op_name="jit(f)/tokamax:{\\"op\\":{\\"__type\\":\\"tokamax._src.ops.ragged_dot.pallas_triton.PallasTritonRaggedDot\\"}}"}'


def _call(result: str, operands: list[str], target: str = "__gpu$xla.gpu.triton", meta: str = _META) -> str:
    cons = ", ".join(f"{o}{{1,0}}" for o in operands)
    return (
        f'  %k = {result}{{1,0}} custom-call(%a, %b), custom_call_target="{target}", '
        f"operand_layout_constraints={{{cons}}}, api_version=API_VERSION_TYPED_FFI, {meta}"
    )


@pytest.mark.parametrize(
    "result, operands, m, n, k, batch",
    [
        ("bf16[4096,1024]", ["bf16[4096,512]", "bf16[8,512,1024]", "s32[8]"], 4096, 1024, 512, 1),  # y = x w
        ("bf16[4096,512]", ["bf16[4096,1024]", "bf16[8,1024,512]", "s32[8]"], 4096, 512, 1024, 1),  # dx = dy w^T
        ("bf16[8,512,1024]", ["s32[8]", "bf16[512,4096]", "bf16[4096,1024]"], 512, 1024, 512, 8),  # dw, x transposed
    ],
)
def test_a_ragged_dot_kernel_costs_two_rows_times_the_group_matrix(result, operands, m, n, k, batch):
    rec = grouped_gemm(_call(result, operands), result)
    assert rec is not None
    assert rec["flops"] == 2 * 4096 * 512 * 1024  # every row meets one (512, 1024) matrix
    assert (rec["m"], rec["n"], rec["k"], rec["batch"], rec["groups"]) == (m, n, k, batch, 8)
    assert rec["bytes"] == (4096 * (512 + 1024) + 8 * 512 * 1024) * 2  # bf16: both row arrays and the matrices


def test_xla_tpu_grouped_matmul_kernel_is_a_grouped_gemm():
    """As XLA:TPU (libtpu 0.0.42.1) compiles `ragged_dot` (tests/test_moe_flops.py's layer)."""
    meta = 'metadata={op_name="jit(f)/ragged_dot_general/ragged-dot-none"}'
    ops = ["s32[1]", "s32[9]", "s32[39]", "s32[39]", "s32[1]", "bf16[4096,512]", "bf16[8,512,1024]"]
    rec = grouped_gemm(_call("bf16[4096,1024]", ops, target="tpu_custom_call", meta=meta), "bf16[4096,1024]")
    assert rec is not None and rec["flops"] == 2 * 4096 * 512 * 1024 and rec["groups"] == 8
    assert (
        grouped_gemm(_call("bf16[4096,1024]", ops, target="tpu_custom_call", meta='metadata={op_name="splash"}'), "")
        is None
    )


def test_other_kernel_calls_are_not_grouped_gemms():
    args = ("bf16[4096,1024]", ["bf16[4096,512]", "bf16[8,512,1024]"])
    assert grouped_gemm(_call(*args, meta='metadata={op_name="jit(f)/flash_attention"}'), args[0]) is None
    assert grouped_gemm(_call(*args, target="__cublas$gemm"), args[0]) is None


def _fake_tokamax(monkeypatch):
    """tokamax's API with XLA's ragged dots behind it: what `grouped_matmul`'s own VJP does
    with the kernels' results is then checkable on CPU (the kernels only run on a GPU)."""
    import sys
    import types

    import fsdp_jax.app.models.grouped_matmul as gm

    fake = types.ModuleType("tokamax")
    fake.ragged_dot = lambda x, w, s, implementation=None: jax.lax.ragged_dot(x, w, s)
    fake.ragged_dot_general = lambda x, y, s, dims, implementation=None: jax.lax.ragged_dot_general(x, y, s, dims)
    monkeypatch.setitem(sys.modules, "tokamax", fake)
    return gm._tokamax


@pytest.mark.parametrize("experts_split", [False, True])  # weights shared by every shard, or each shard's own
def test_the_tokamax_path_differentiates_as_ragged_dot_also_inside_a_shard_map(monkeypatch, experts_split):
    from jax.sharding import PartitionSpec as P

    kernel = _fake_tokamax(monkeypatch)
    rng = np.random.default_rng(1)
    n_dev, m, k, n, g = 8, 12, 6, 5, 3
    x = jnp.asarray(rng.standard_normal((n_dev * m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal(((n_dev if experts_split else 1) * g, k, n)), jnp.float32)
    sizes = jnp.asarray(np.tile([4, 0, 6], n_dev), jnp.int32)  # per shard: 10 of its 12 rows grouped
    mesh = jax.make_mesh((n_dev,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,))

    w_spec = P("fsdp") if experts_split else P()

    def loss(dot):
        def local(x, w, s):
            y = dot(x, w, s)
            return jax.lax.psum(jnp.sum(jnp.sin(y)), "fsdp")

        return jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), w_spec, P("fsdp")), out_specs=P())

    want = jax.jit(jax.grad(loss(jax.lax.ragged_dot), argnums=(0, 1)))(x, w, sizes)
    got = jax.jit(jax.grad(loss(kernel), argnums=(0, 1)))(x, w, sizes)
    for a, b in zip(got, want):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(want[1]).max()) > 0


def installed_tokamax(module: str):
    """`module`, imported: the test skips only where tokamax is not installed; where it is, a
    private tokamax / Pallas path that moved fails the test (it skipped before)."""
    if importlib.util.find_spec("tokamax") is None:
        pytest.skip("tokamax is not installed")
    return importlib.import_module(module)


def test_the_private_kernel_paths_import_where_tokamax_is_installed():
    """The paths the interpreted-kernel tests reach into (each one a moved path that used to skip)."""
    for module in ("tokamax._src.ops.ragged_dot.pallas_mosaic_tpu", "jax._src.pallas.mosaic.tpu_info"):
        assert installed_tokamax(module) is not None


def _interpreted_tpu_kernel(monkeypatch):
    """tokamax's Mosaic TPU ragged dot (megablox gmm / tgmm) in Pallas's interpret mode, behind
    `grouped_matmul` as if the step were lowered for a TPU v5: the kernel's own code runs on
    CPU. Its tiling asks jax for the TPU's layout, which CPU lacks: the CPU device kind is
    registered as a v5p (jax's private table of TPU kinds)."""
    pmt = installed_tokamax("tokamax._src.ops.ragged_dot.pallas_mosaic_tpu")
    tpu_info = installed_tokamax("jax._src.pallas.mosaic.tpu_info")
    import fsdp_jax.app.models.grouped_matmul as gm

    kind = jax.devices()[0].device_kind
    monkeypatch.setitem(
        tpu_info.registry, kind, lambda: tpu_info.get_tpu_info_for_chip(tpu_info.ChipVersion.TPU_V5P, 1)
    )
    monkeypatch.setattr(pmt.PallasMosaicTpuRaggedDot, "supported_on", lambda self, device: True)
    impl = pmt.PallasMosaicTpuRaggedDot(interpret=True)
    monkeypatch.setattr(gm, "lowering_platform", lambda: "tpu")
    monkeypatch.setattr(gm, "_tpu_generation", lambda: 5)
    monkeypatch.setattr(gm, "_kernels", lambda x, y: (impl,))
    return gm


@pytest.mark.slow
@pytest.mark.parametrize("shards", [1, 2])  # 2: inside a shard_map, weights shared by the shards
def test_tokamax_tpu_kernel_forward_and_grads_equal_xla_ragged_dot(monkeypatch, shards):
    gm = _interpreted_tpu_kernel(monkeypatch)
    from jax.sharding import PartitionSpec as P

    rng = np.random.default_rng(2)
    m, k, n = 256, 128, 256  # per shard: whole 128-tiles, as the kernel takes
    x = jnp.asarray(rng.standard_normal((shards * m, k)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((4, k, n)) / np.sqrt(k), jnp.float32)
    # groups that end inside a tile, an empty one, and a tail of rows in no group
    sizes = jnp.asarray(np.tile([57, 0, 130, 41], shards), jnp.int32)
    mesh = jax.make_mesh((shards,), ("fsdp",), axis_types=(jax.sharding.AxisType.Auto,), devices=jax.devices()[:shards])

    def loss(impl):
        def local(x, w, s):
            y = gm.grouped_matmul(x, w, s, impl)
            return jax.lax.psum(jnp.sum(jnp.sin(y)), "fsdp"), y

        return jax.shard_map(local, mesh=mesh, in_specs=(P("fsdp"), P(), P("fsdp")), out_specs=(P(), P("fsdp")))

    run = {
        impl: jax.jit(jax.value_and_grad(loss(impl), argnums=(0, 1), has_aux=True))(x, w, sizes)
        for impl in ("tokamax", "xla")
    }
    (_, y), grads = run["tokamax"]
    (_, y0), grads0 = run["xla"]
    np.testing.assert_allclose(np.asarray(y), np.asarray(y0), rtol=1e-5, atol=1e-5)
    assert not np.asarray(y).reshape(shards, m, n)[:, 228:].any()  # the tail: 0
    for got, want in zip(grads, grads0):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
    assert float(jnp.abs(grads0[1]).max()) > 0


@pytest.mark.parametrize(
    "dims, auto, refused",
    [
        ((4096, 512, 1024), "tokamax", None),
        ((4096, 512, 16), "xla", "output 16 not a multiple of 128"),  # a LoRA adapter's rank
        ((300, 512, 1024), "xla", "rows 300 not a multiple of 128"),
    ],
)
def test_on_tpu_auto_takes_tokamax_where_its_kernel_fits_and_tokamax_refuses_the_rest(monkeypatch, dims, auto, refused):
    installed_tokamax("tokamax")
    import fsdp_jax.app.models.grouped_matmul as gm

    monkeypatch.setattr(gm, "lowering_platform", lambda: "tpu")
    monkeypatch.setattr(gm, "_tpu_generation", lambda: 5)
    assert resolve("auto", dims) == auto and resolve("xla", dims) == "xla"
    if refused:
        with pytest.raises(ConfigError, match=rf"^model\.grouped_matmul: .*{refused}"):
            resolve("tokamax", dims)
    else:
        assert resolve("tokamax", dims) == "tokamax"
    monkeypatch.setattr(gm, "_tpu_generation", lambda: 4)  # tokamax's TPU kernel needs v5+
    assert resolve("auto", dims) == "xla"
    with pytest.raises(ConfigError, match=r"^model\.grouped_matmul: tokamax runs on GPU and TPU v5\+ only"):
        resolve("tokamax", dims)


def test_on_a_gpu_whose_tokamax_lacks_a_kernel_for_the_dtype_auto_is_xla_and_tokamax_refused(monkeypatch):
    """tokamax 0.0.17 without jax_triton has only its Mosaic GPU kernel, which takes bf16 / f16
    operands (an f32 step under auto failed in it: "Only bfloat16/float16 inputs are supported",
    8 x H100, jax 0.12): f32 rows under auto run XLA's ragged_dot, under tokamax one line naming
    model.grouped_matmul; bf16 rows, or a tokamax with its Triton kernel, still take tokamax's."""
    installed_tokamax("tokamax")
    import fsdp_jax.app.models.grouped_matmul as gm

    monkeypatch.setattr(gm, "lowering_platform", lambda: "gpu")
    monkeypatch.setattr(gm, "_tokamax_implementations", lambda: ("xla", "mosaic_gpu"))
    took = []
    monkeypatch.setattr(gm, "_tokamax", lambda x, w, s: took.append(x.dtype.name) or jax.lax.ragged_dot(x, w, s))
    x = jax.random.normal(jax.random.key(0), (8, 4))
    w = jax.random.normal(jax.random.key(1), (2, 4, 3))
    sizes = jnp.array([3, 4], jnp.int32)
    np.testing.assert_array_equal(grouped_matmul(x, w, sizes, "auto"), jax.lax.ragged_dot(x, w, sizes))
    assert took == []
    with pytest.raises(ConfigError, match=r"^model\.grouped_matmul: tokamax's Mosaic GPU kernel takes bfloat16 or "):
        grouped_matmul(x, w, sizes, "tokamax")
    grouped_matmul(x.astype(jnp.bfloat16), w.astype(jnp.bfloat16), sizes, "auto")
    assert took == ["bfloat16"]
    monkeypatch.setattr(gm, "_tokamax_implementations", lambda: ("xla", "triton", "mosaic_gpu"))
    grouped_matmul(x, w, sizes, "tokamax")
    assert took == ["bfloat16", "float32"]


# tokamax's Mosaic TPU weight-gradient kernel (megablox tgmm) as XLA:TPU prints it (libtpu
# 0.0.42.1, the deviceless v5p compile of tests/test_moe_flops.py's layer, metadata shortened):
# its kernel metadata spans lines, and the op_name naming tokamax's ragged dot comes last
_TGMM = (
    "  %tgmm_megablox.1 = bf16[8,512,1024]{2,1,0:T(8,128)(2,1)} custom-call(%bitcast.10, %pad_add_fusion.1, "
    "%copy-done.3, %copy-done.4, %constant.130, /*index=5*/%copy-done.2, %copy-done), "
    'custom_call_target="tpu_custom_call", operand_layout_constraints={s32[1]{0}, s32[9]{0}, s32[39]{0}, '
    "s32[39]{0}, s32[1]{0}, bf16[4096,512]{1,0}, bf16[4096,1024]{1,0}}, frontend_attributes={kernel_metadata={\n"
    '"xprof_metadata":"{\\"tiling\\": {\\"tile_m\\": 128, \\"tile_k\\": 128, \\"tile_n\\": 128}}"\n'
    '}}, metadata={op_name="jit(f)/transpose(jvp())/tokamax:{\\"op\\":{\\"__type\\":'
    '\\"tokamax._src.ops.ragged_dot.pallas_mosaic_tpu.PallasMosaicTpuRaggedDot\\"}}"}'
)


def test_tokamax_tpu_weight_gradient_kernel_over_several_lines_is_one_grouped_gemm():
    from fsdp_jax.hlo.costs import op_inventory

    hlo = (
        "HloModule m\n\nENTRY %main (a: s32[1], b: bf16[4096,512], c: bf16[4096,1024]) -> bf16[8,512,1024] {\n"
        "  %bitcast.10 = s32[1]{0} parameter(0)\n  %copy-done.2 = bf16[4096,512]{1,0} parameter(1)\n"
        "  %copy-done = bf16[4096,1024]{1,0} parameter(2)\n"
        + _TGMM
        + "\n  ROOT %t = (bf16[8,512,1024]) tuple(%tgmm_megablox.1)\n}\n"
    )
    (rec,) = [o for o in op_inventory(hlo) if o["name"] == "tgmm_megablox.1"]
    assert rec["kind"] == "gemm" and rec["groups"] == 8 and "tokamax" in rec["op_name"]
    assert rec["flops"] == 2 * 4096 * 512 * 1024  # every row once, against its group's (512, 1024)
    assert (rec["m"], rec["n"], rec["batch"]) == (512, 1024, 8)
