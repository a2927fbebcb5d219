"""fsdp_jax.checkpoint.safetensors_io against the `safetensors` library and numpy slicing: the
writer's files read back by the reference reader, every block `read` takes equal to
slicing the whole array (any rank, any dtype, across chunk boundaries), and
`load_safetensors` placing a file sharded. Hostile files: tests/test_hostile.py."""

import itertools

import jax
import ml_dtypes
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from fsdp_jax import checkpoint as ck
from fsdp_jax.checkpoint import safetensors_io as sio
from fsdp_jax.sharding.mesh import make_mesh

RNG = np.random.default_rng(0)
ARRAYS = {
    "scalar": np.array(3.5, np.float32),
    "vec": RNG.standard_normal(7).astype(np.float16),
    "mat": RNG.integers(-100, 100, (8, 5)).astype(np.int32),
    "bf16": RNG.standard_normal((4, 8, 5)).astype(ml_dtypes.bfloat16),
    "empty": np.zeros((0, 3), np.float32),
    "mask": RNG.random((3, 4)) > 0.5,
}


@pytest.fixture
def written(tmp_path):
    path = tmp_path / "t.safetensors"
    size = sio.write_safetensors(
        path, [(n, a.shape, a.dtype) for n, a in ARRAYS.items()], ARRAYS.__getitem__, {"format": "np"}
    )
    assert size == path.stat().st_size
    return path


def test_writer_agrees_with_the_reference_reader(written):
    from safetensors.numpy import load_file

    assert sio.check_file(written)["bf16"] == ([4, 8, 5], "BF16")
    ref = load_file(written)
    for n, a in ARRAYS.items():
        if a.dtype != ml_dtypes.bfloat16:  # the numpy backend has no bfloat16
            np.testing.assert_array_equal(ref[n], a)
    f = sio.SafetensorsFile(written)
    assert f.metadata == {"format": "np"} and list(f.tensors) == list(ARRAYS)


def _slices(n):
    return [None, slice(0, n), slice(1, max(1, n - 1)), slice(n // 2, n)]


@pytest.mark.parametrize("chunk", [1, 1 << 20])  # one row per pread, or one pread
def test_every_block_equals_numpy_slicing(written, monkeypatch, chunk):
    monkeypatch.setattr(sio, "_CHUNK_BYTES", chunk)
    f = sio.SafetensorsFile(written)
    for n, a in ARRAYS.items():
        assert f.shape(n) == a.shape and f.dtype(n) == a.dtype
        np.testing.assert_array_equal(f.read(n), a)
        for k in range(1, a.ndim + 1):
            for idx in itertools.product(*(_slices(d) for d in a.shape[:k])):
                want = a[tuple(s or slice(None) for s in idx)]
                got = f.read(n, *idx)
                assert got.dtype == a.dtype and got.shape == want.shape, (n, idx)
                np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(f.read("bf16", slice(1, 3), dtype=np.float32), ARRAYS["bf16"][1:3].astype(np.float32))
    assert f.dtype("bf16") == ml_dtypes.bfloat16
    with pytest.raises(sio.SafetensorsError, match="no tensor 'nope'"):
        f.read("nope")


def test_truncated_file_is_one_line_naming_it(written):
    f = sio.SafetensorsFile(written)
    written.write_bytes(written.read_bytes()[: f.tensors["mask"][2]])  # the last tensor cut off
    with pytest.raises(sio.SafetensorsError, match="'mask' is truncated"):
        f.read("mask")  # checked before the file changed
    with pytest.raises(
        ck.CheckpointError,
        match=f"{written}: not a valid safetensors file "
        r"\(tensor 'mask' lies outside the file",
    ):
        ck.open_safetensors(written)


def test_load_safetensors_places_shards(written):
    """Sharded on a leading and an inner dimension, replicated, scalar and empty leaves;
    bf16 cast to float32 on the way."""
    mesh = make_mesh(1, 8, 1)
    axis = mesh.axis_names[1]
    specs = {"bf16": P(None, axis), "mat": P(axis)}
    dtypes = {"bf16": np.float32}

    def abstract(shapes):
        return {
            n: jax.ShapeDtypeStruct(
                shapes.get(n, a.shape), dtypes.get(n, a.dtype), sharding=NamedSharding(mesh, specs.get(n, P()))
            )
            for n, a in ARRAYS.items()
        }

    with pytest.raises(
        ck.CheckpointError,
        match=r"does not fit the model \(bf16: checkpoint \(4, 8, 5\) "
        r"vs model \(4, 16, 5\)\)",
    ):
        ck.load_safetensors(written, abstract({"bf16": (4, 16, 5)}))
    want = abstract({})
    loaded = ck.load_safetensors(written, want)
    for n, a in ARRAYS.items():
        assert loaded[n].sharding == want[n].sharding and loaded[n].dtype == want[n].dtype
        np.testing.assert_array_equal(np.asarray(loaded[n]), a.astype(want[n].dtype))
