"""Mesh construction, the logical rules table, the fallback rule and explain."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import fsdp_jax as fj
from fsdp_jax.errors import ReplicatedWarning
from fsdp_jax.sharding.mesh import is_explicit
from fsdp_jax.sharding.reasons import PROSE, Note, Why
from fsdp_jax.sharding.replication import summarize
from fsdp_jax.sharding.rules import decide_leaf, plan_leaf


def test_mesh_fills_minus_one():
    mesh = fj.make_mesh(data=2, fsdp=-1, tensor=1)
    assert dict(mesh.shape) == {"data": 2, "fsdp": 4, "context": 1, "tensor": 1}
    assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
    explicit = fj.make_mesh(fsdp=8, axis_types="explicit")
    assert all(t == jax.sharding.AxisType.Explicit for t in explicit.axis_types)
    assert is_explicit(explicit) and not is_explicit(mesh)
    with pytest.raises(fj.MeshError, match="axis_types 'manual': choose one of auto, explicit"):
        fj.make_mesh(fsdp=8, axis_types="manual")


@pytest.mark.parametrize(
    "sizes, words",
    [
        ((3, -1, 1), ["data=3", "8 devices", "not divisible"]),
        ((2, 2, 1), ["multiply to 4", "8 devices"]),
        ((-1, -1, 1), ["at most one axis may be -1"]),
        ((0, 8, 1), ["positive"]),
    ],
)
def test_mesh_errors_name_sizes_and_count(sizes, words):
    with pytest.raises(fj.MeshError) as e:
        fj.make_mesh(*sizes)
    for w in words:
        assert w in str(e.value)


def test_logical_to_spec_first_dim_wins_and_fsdp_expands():
    assert fj.logical_to_spec(("batch", "length", "embed")) == P(("data", "fsdp"), "context", None)
    assert fj.logical_to_spec(("embed", "mlp")) == P("fsdp", "tensor")
    assert fj.logical_to_spec(("embed", "mlp"), shard_axes=("data", "fsdp")) == P(("data", "fsdp"), "tensor")
    assert fj.logical_to_spec(("embed", "unknown_name")) == P("fsdp", None)
    custom = {"embed": None, "mlp": "fsdp"}
    assert fj.logical_to_spec(("embed", "mlp"), custom) == P(None, "fsdp")


def test_fallback_largest_divisible_dim_and_threshold():
    mesh = fj.make_mesh(fsdp=8)
    assert decide_leaf((100, 512), None, mesh) == (
        P(None, "fsdp"),
        (Note(Why.FALLBACK, dim=1, size=512, axes=("fsdp",), n=8),),
    )
    row, _ = plan_leaf("w", (1024, 36), "float32", None, mesh)
    assert row.spec == P("fsdp", None)
    assert row.bytes_per_device == 1024 * 36 * 4 // 8
    assert decide_leaf((512,), None, mesh) == (P(None), (Note(Why.THRESHOLD, size=512, limit=2**14),))
    spec, notes = decide_leaf((8, 4096), None, mesh, min_shard_size=10**9)
    assert spec == P(None, None) and notes == (Note(Why.THRESHOLD, size=8 * 4096, limit=10**9),)
    assert decide_leaf((), None, mesh) == (P(), (Note(Why.SCALAR),))
    assert decide_leaf((64, 512), None, fj.make_mesh(data=8, fsdp=1)) == (P(None, None), (Note(Why.NO_SHARD_AXIS),))


def test_unshardable_leaf_is_reported_by_path_shape_and_axis_size():
    mesh = fj.make_mesh(fsdp=8)
    params = {"ok": jnp.zeros((64, 512)), "odd": jnp.zeros((129, 257))}
    with pytest.raises(fj.ShardingError) as e:
        fj.explain(params, mesh)
    msg = str(e.value)
    assert "odd" in msg and "(129, 257)" in msg and "fsdp=8" in msg and "Fix" in msg
    rows = fj.explain(params, mesh, allow_unshardable=True)
    assert {r.path: r.replicated for r in rows} == {"odd": True, "ok": False}


def test_logical_rule_that_does_not_divide_falls_back():
    mesh = fj.make_mesh(fsdp=8)
    spec, notes = decide_leaf((100, 1024), ("embed", "mlp"), mesh)
    assert spec == P(None, "fsdp")
    assert [n.kind for n in notes] == [Why.LOGICAL, Why.NOT_DIVISIBLE, Why.FALLBACK]
    assert notes[1] == Note(Why.NOT_DIVISIBLE, names=("embed",), axes=("fsdp",), dim=0, size=100, n=8)
    assert (notes[2].dim, notes[2].axes) == (1, ("fsdp",))


def test_unknown_logical_names_fall_back_and_explain_says_so():
    mesh = fj.make_mesh(fsdp=8)
    rows = fj.explain({"w": jnp.zeros((48, 512))}, mesh, logical_axes={"w": ("my_in", "my_out")})
    assert rows[0].spec == P(None, "fsdp")
    assert rows[0].kinds == (Why.LOGICAL, Why.UNKNOWN_NAMES, Why.FALLBACK)
    assert rows[0].notes[1].names == ("my_in", "my_out")
    assert "my_in, my_out" in rows[0].reason  # the prose names them too


@pytest.mark.parametrize("names", [("fsdp", "tensor"), ("embed_dim", "ffw")])
def test_unknown_names_warn_once_with_the_rules_fix(names):
    """A model naming dims the table does not know (Gemma's sharding config names them
    after mesh axes) gets no tensor parallelism: make_plan says so, once, with the fix."""
    mesh = fj.make_mesh(fsdp=4, tensor=2)
    params = {"a": jax.ShapeDtypeStruct((64, 256), jnp.float32), "b": jax.ShapeDtypeStruct((256, 64), jnp.float32)}
    axes_ = {"a": names, "b": names[::-1]}
    with pytest.warns(fj.UnknownNamesWarning) as rec:
        plan = fj.make_plan(params, optax.sgd(0.1), mesh, "full_shard", axes_)
    assert len(rec) == 1
    msg = str(rec[0].message)
    assert all(n in msg for n in names) and "rules=" in msg and "tensor=2" in msg
    assert not any("tensor" in str(r.spec) for r in plan.rows)
    rules = fj.merge_rules({names[0]: "fsdp", names[1]: "tensor"})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        plan = fj.make_plan(params, optax.sgd(0.1), mesh, "full_shard", axes_, rules)
    assert [r.spec for r in plan.rows] == [P("fsdp", "tensor"), P("tensor", "fsdp")]


def test_fewer_names_than_dims_leave_trailing_dims_unsharded():
    mesh = fj.make_mesh(fsdp=4, tensor=2)
    spec, notes = decide_leaf((64, 4, 16), ("embed", "heads"), mesh)
    assert spec == P("fsdp", "tensor", None)
    assert notes == (
        Note(Why.LOGICAL, mapped=(("embed", ("fsdp",)), ("heads", ("tensor",)))),
        Note(Why.UNNAMED_TRAILING, dims=(2,)),
    )
    with pytest.raises(fj.ShardingError, match=r"w: logical names .* 3 entries .* 2 dims"):
        plan_leaf("w", (64, 16), "float32", ("embed", "heads", "kv"), mesh)


def test_explain_rows_carry_everything():
    mesh = fj.make_mesh(fsdp=8)
    rows = fj.explain({"w": jax.ShapeDtypeStruct((64, 256), jnp.bfloat16)}, mesh, logical_axes={"w": ("embed", "mlp")})
    d = rows[0].as_dict()
    assert d == {
        "path": "w",
        "shape": [64, 256],
        "dtype": "bfloat16",
        "spec": "P(fsdp, None)",
        "bytes_per_device": 64 * 256 * 2 // 8,
        "total_bytes": 64 * 256 * 2,
        "reason": rows[0].reason,
    }
    assert rows[0].notes == (Note(Why.LOGICAL, mapped=(("embed", ("fsdp",)),)),)
    assert set(PROSE) == set(Why)  # every kind of reason has prose


def test_sufficiently_sharded_check():
    mesh = fj.make_mesh(fsdp=8)
    # a large leaf deliberately replicated by its logical names (norm -> None)
    params = {"w": jnp.zeros((64, 512)), "big_norm": jnp.zeros((4096,))}
    axes_ = {"w": ("embed", "mlp"), "big_norm": ("norm",)}
    rows = fj.explain(params, mesh, axes_)
    with pytest.raises(fj.ShardingError, match=r"11\.1% of parameter bytes are replicated.*big_norm"):
        fj.check_sufficiently_sharded(rows, ("fsdp",), mesh, min_replicated_bytes=0)
    assert fj.check_sufficiently_sharded(rows, ("fsdp",), mesh, 0.2) == pytest.approx(4096 / (64 * 512 + 4096))
    # the same fraction in few bytes (16 KiB, under the 16 MiB floor) warns instead of failing
    with pytest.warns(ReplicatedWarning, match="11.1%"):
        assert fj.check_sufficiently_sharded(rows, ("fsdp",), mesh) == pytest.approx(0.111, abs=1e-3)
    s = summarize(rows, ("fsdp",), mesh)
    assert (s.total_bytes, s.replicated_bytes, s.bytes_per_device) == (
        (64 * 512 + 4096) * 4,
        4096 * 4,
        64 * 512 * 4 // 8 + 4096 * 4,
    )
    # large replicated bytes (abstract: nothing allocated) still fail at the default floor
    big = {
        "w": jax.ShapeDtypeStruct((4096, 8192), jnp.float32),
        "big_norm": jax.ShapeDtypeStruct((2**23,), jnp.float32),
    }
    with pytest.raises(fj.ShardingError, match="big_norm"):
        fj.check_sufficiently_sharded(fj.explain(big, mesh, axes_), ("fsdp",), mesh)


def test_merge_rules_validates_mesh_axes():
    r = fj.merge_rules({"mlp": None, "heads": ["fsdp", "tensor"], "new": "data"})
    assert r["mlp"] is None and r["heads"] == ("fsdp", "tensor") and r["new"] == "data"
    assert r["embed"] == fj.DEFAULT_RULES["embed"]
    for bad in ("model", ["fsdp", "fsdp"], 3):
        with pytest.raises(fj.ShardingError, match="mesh axes: data, fsdp, context, tensor"):
            fj.merge_rules({"mlp": bad})


def test_logical_axes_from_nnx_and_linen():
    from flax import linen as nn
    from flax import nnx

    class Lin(nn.Module):
        @nn.compact
        def __call__(self, x):
            w = self.param("w", nn.with_logical_partitioning(nn.initializers.normal(), ("embed", "mlp")), (4, 8))
            b = self.param("b", nn.initializers.zeros, (8,))
            return x @ w + b

    variables = jax.eval_shape(Lin().init, jax.random.key(0), jnp.ones((1, 4)))
    values, names = fj.logical_axes_of(variables)
    assert names["params"]["w"] == ("embed", "mlp") and names["params"]["b"] is None
    assert values["params"]["w"].shape == (4, 8)

    with nnx.use_eager_sharding(False):
        m = nnx.eval_shape(
            lambda: nnx.Linear(
                4, 8, kernel_init=nnx.with_partitioning(nnx.initializers.normal(), ("embed", "mlp")), rngs=nnx.Rngs(0)
            )
        )
    _, names = fj.logical_axes_of(nnx.state(m, nnx.Param))
    flat = jax.tree.leaves(names, is_leaf=lambda x: x is None or isinstance(x, tuple))
    assert ("embed", "mlp") in flat and None in flat


def test_strategy_lookup_and_aliases():
    assert fj.get_strategy("zero3").name == "full_shard"
    assert fj.get_strategy("ZERO2").name == "shard_grad_op"
    assert fj.get_strategy("ddp").name == "no_shard"
    assert fj.get_strategy("hsdp").name == "hybrid_shard"
    assert fj.get_strategy("zero1").name == "shard_opt"
    with pytest.raises(ValueError, match="unknown strategy 'zero4'; choose one of full_shard"):
        fj.get_strategy("zero4")


def test_precision_and_remat_parse():
    p = fj.Policy.parse("params=float32,compute=bfloat16")
    assert (p.param_dtype, p.compute_dtype, p.reduce_dtype, p.output_dtype) == (
        np.dtype("float32"),
        jnp.bfloat16,
        np.dtype("float32"),
        np.dtype("float32"),
    )
    assert fj.Policy.parse(str(p)) == p
    assert fj.Policy.parse("bf16").compute_dtype == jnp.bfloat16
    with pytest.raises(ValueError, match="unknown field 'comp'"):
        fj.Policy.parse("comp=bfloat16")
    with pytest.raises(ValueError, match="unknown dtype 'int8'"):
        fj.Policy.parse("compute=int8")
    assert fj.get_policy("none") is None
    assert fj.get_policy("dots") is jax.checkpoint_policies.checkpoint_dots
    with pytest.raises(ValueError, match="unknown remat policy 'dot'; choose one of none, full, dots"):
        fj.get_policy("dot")
