"""Checkpoints as raw shard files (issue 43, item 5): one file per distinct shard,
checksummed as written, a JSON index, restore onto any mesh / sharding / memory kind with
the checksums verified on read, saves straight from pinned_host memory, and the
Checkpointer's contracts (async, atomic commit, damage fallback) over that payload, with
Orbax-written steps still restoring."""

import json
import os
import zlib
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import fsdp_jax as fj
from fsdp_jax import checkpoint as ck
from fsdp_jax.checkpoint import shard_files as sf
from fsdp_jax.errors import ShardFileError

HOST = "pinned_host"


def mesh(*shape, names=("fsdp",)):
    n = int(np.prod(shape))
    return jax.make_mesh(shape, names, axis_types=(jax.sharding.AxisType.Auto,) * len(shape), devices=jax.devices()[:n])


def source():
    """Host numpy values of every kind the trainer's state holds."""
    rng = np.random.default_rng(0)
    return {
        "params": {
            "w": rng.standard_normal((64, 12)).astype(np.float32),
            "bf": rng.standard_normal((16, 8)).astype(jnp.bfloat16),
            "b": np.arange(10, dtype=np.int32),
        },
        "step": np.int32(7),
    }


def saved_state(values):
    m = mesh(8)
    specs = {"params": {"w": P("fsdp"), "bf": P(None, "fsdp"), "b": P()}, "step": P()}
    kinds = {"params": {"w": "device", "bf": HOST, "b": "device"}, "step": "device"}
    return jax.tree.map(lambda v, s, k: jax.device_put(v, NamedSharding(m, s, memory_kind=k)), values, specs, kinds)


def target(values, m, specs, kind="device", dtype=None):
    return jax.tree.map(
        lambda v, s: jax.ShapeDtypeStruct(v.shape, dtype or v.dtype, sharding=NamedSharding(m, s, memory_kind=kind)),
        values,
        specs,
    )


def test_files_index_and_checksums(tmp_path):
    """One file per distinct shard (a replicated leaf once), its bytes the shard's in C
    order, the index's CRC-32 the file's (zlib over the file, independently)."""
    values = source()
    pieces, meta = sf.host_shards(saved_state(values))
    index = sf.write_shards(tmp_path, pieces, meta)
    leaves = index["leaves"]
    assert {p: len(m["files"]) for p, m in leaves.items()} == {"params/w": 8, "params/bf": 8, "params/b": 1, "step": 1}
    assert leaves["params/bf"]["dtype"] == "bfloat16" and leaves["params/w"]["shape"] == [64, 12]
    for path, m in leaves.items():
        full = values[path.split("/")[0]] if path == "step" else values["params"][path.split("/")[1]]
        for e in m["files"]:
            blob = (tmp_path / e["file"]).read_bytes()
            assert f"{zlib.crc32(blob):08x}" == e["crc32"] and len(blob) == e["bytes"]
            want = np.asarray(full)[tuple(slice(a, b) for a, b in zip(e["start"], e["stop"]))]
            assert blob == bytes(e["offset"]) + np.ascontiguousarray(want).tobytes()
    assert json.loads((tmp_path / "shards.0.json").read_text()) == index


@pytest.mark.parametrize(
    "shape,names,specs,kind",
    [
        ((4,), ("fsdp",), {"params": {"w": P("fsdp"), "bf": P("fsdp"), "b": P()}, "step": P()}, "device"),
        (
            (2, 4),
            ("data", "fsdp"),
            {"params": {"w": P(None, "fsdp"), "bf": P("data", "fsdp"), "b": P()}, "step": P()},
            HOST,
        ),
        ((1,), ("fsdp",), {"params": {"w": P(), "bf": P(), "b": P()}, "step": P()}, "device"),
        ((8,), ("fsdp",), {"params": {"w": P(("fsdp",)), "bf": P(None, "fsdp"), "b": P("fsdp")}, "step": P()}, HOST),
    ],
)
def test_restore_onto_any_mesh_sharding_and_memory_kind(tmp_path, shape, names, specs, kind):
    values = source()
    if specs["params"]["b"] == P("fsdp"):  # 10 does not split 8 ways: a leaf of its own shape
        values["params"]["b"] = np.arange(16, dtype=np.int32)
    sf.write_shards(tmp_path, *sf.host_shards(saved_state(values)))
    out = sf.read_tree(tmp_path, target(values, mesh(*shape, names=names), specs, kind))
    for got, want, spec in zip(jax.tree.leaves(out), jax.tree.leaves(values), jax.tree.leaves(specs)):
        np.testing.assert_array_equal(np.asarray(got), want)
        assert got.dtype == want.dtype and got.sharding.spec == spec and got.sharding.memory_kind == kind


def test_restore_casts_and_reads_only_the_needed_files(tmp_path, monkeypatch):
    values = {"w": np.arange(64 * 4, dtype=np.float32).reshape(64, 4)}
    m8 = mesh(8)
    sf.write_shards(tmp_path, *sf.host_shards({"w": jax.device_put(values["w"], NamedSharding(m8, P("fsdp")))}))
    read = []
    real = sf.start_load
    monkeypatch.setattr(sf, "start_load", lambda d, e, *a: read.append(e["file"]) or real(d, e, *a))
    t = {"w": jax.ShapeDtypeStruct((64, 4), jnp.bfloat16, sharding=NamedSharding(mesh(2), P("fsdp")))}
    out = sf.read_tree(tmp_path, t)
    np.testing.assert_array_equal(np.asarray(out["w"]), values["w"].astype(jnp.bfloat16))
    assert out["w"].dtype == jnp.bfloat16 and len(read) == 8  # 2 devices need all 8 files, once each
    read.clear()
    sub = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    assert sf.read_whole(tmp_path, "w").shape == (64, 4) and len(read) == 8
    with pytest.raises(ShardFileError, match=r"w saved \(64, 4\), wanted \(32, 4\)"):
        sf.read_tree(tmp_path, {"w": jax.ShapeDtypeStruct((32, 4), np.float32, sharding=sub)})


def test_saving_offloaded_state_moves_nothing_to_the_device(tmp_path, monkeypatch):
    values = source()
    state = saved_state(values)
    assert state["params"]["bf"].sharding.memory_kind == HOST
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: pytest.fail("a save called device_put"))
    sf.write_shards(tmp_path, *sf.host_shards(state))
    monkeypatch.undo()
    got = sf.read_whole(tmp_path, "params/bf")
    np.testing.assert_array_equal(got, values["params"]["bf"])


def test_checkpointer_returns_after_the_host_copy_then_commits(tmp_path):
    """`save` returns once the shards are host copies: deleting the arrays right after it
    loses nothing; the step commits atomically with its manifest."""
    values = source()
    state = saved_state(values)
    c = ck.Checkpointer(tmp_path / "c", keep=2)
    c.save(1, state, {"note": "x"})
    for x in jax.tree.leaves(state):
        x.delete()
    c.wait()
    step = c.step_dir(1)
    assert sf.is_shard_dir(step / "state") and c.check_files(1) is None
    assert not list((tmp_path / "c").glob(f"*{ck.TMP_SUFFIX}*"))
    manifest = json.loads((step / ck.MANIFEST).read_text())
    for e in sf.read_index(step / "state")["params/w"]["files"]:  # the writer's CRCs, committed
        assert manifest["crc32"][f"state/{e['file']}"] == e["crc32"]
    r = c.restore(target(values, mesh(4), {"params": {"w": P("fsdp"), "bf": P(), "b": P()}, "step": P()}))
    assert r.extras == {"note": "x"} and r.step == 1
    np.testing.assert_array_equal(np.asarray(r.state["params"]["bf"]), values["params"]["bf"])
    c.close()


def test_flipped_shard_byte_falls_back_and_names_the_file(tmp_path):
    values = source()
    c = ck.Checkpointer(tmp_path / "c", keep=None)
    for s in (1, 2):
        c.save(s, saved_state(values))
    c.close()
    e = sf.read_index(c.step_dir(2) / "state")["params/w"]["files"][3]
    f = c.step_dir(2) / "state" / e["file"]
    blob = bytearray(f.read_bytes())
    blob[5] ^= 0x10
    f.write_bytes(bytes(blob))
    t = target(values, mesh(8), {"params": {"w": P("fsdp"), "bf": P(), "b": P()}, "step": P()})
    r = ck.Checkpointer(tmp_path / "c", read_only=True).restore(t)
    assert r.step == 1 and f"state/{e['file']} has changed since it was saved" in r.warnings[0]
    with pytest.raises(ck.CheckpointError, match=f"step 2: state/{e['file']} has changed"):
        ck.Checkpointer(tmp_path / "c", read_only=True).restore(t, step=2)
    assert ck.Checkpointer(tmp_path / "c", read_only=True).check_files(2).startswith(f"state/{e['file']} has changed")


def test_orbax_written_steps_restore_and_the_run_goes_on_in_shards(tmp_path):
    """A directory whose old steps Orbax wrote (payload="orbax", as earlier releases): one
    Checkpointer restores them, saves new steps as shard files, and restores those."""
    values = source()
    c = ck.Checkpointer(tmp_path / "c", keep=None, payload="orbax")
    c.save(1, saved_state(values))
    c.close()
    assert not sf.is_shard_dir(tmp_path / "c" / "1" / "state")
    t = target(values, mesh(2), {"params": {"w": P("fsdp"), "bf": P(), "b": P()}, "step": P()})
    c = ck.Checkpointer(tmp_path / "c", keep=None)
    old = c.restore(t)
    c.save(2, old.state)
    c.wait()
    assert sf.is_shard_dir(c.step_dir(2) / "state")
    for s in (1, 2):
        got = c.restore(t, step=s).state
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(values)):
            np.testing.assert_array_equal(np.asarray(a), b)
        assert c.read_leaf(s, "params/w").shape == (64, 12)
        assert tuple(c.saved_metadata(s)["params/bf"].shape) == (16, 8)
    params, step, _ = c.restore_params(t["params"])
    assert step == 2 and params["w"].sharding.spec == P("fsdp")
    c.close()
    with pytest.raises(ValueError, match="payload: 'zarr' is not one of shards, orbax"):
        ck.Checkpointer(tmp_path / "d", payload="zarr")
    assert isinstance(fj.checkpoint.Checkpointer(tmp_path / "c", read_only=True), ck.Checkpointer)


def test_a_donating_step_right_after_save_does_not_change_what_is_written(tmp_path):
    """The next train step donates the state while the background write runs: the
    checkpoint holds the values as they were at `save`."""
    m = mesh(8)
    big = np.arange(8 * 1024 * 256, dtype=np.float32).reshape(8 * 1024, 256)
    state = {"w": jax.device_put(big, NamedSharding(m, P("fsdp")))}
    step = jax.jit(lambda t: jax.tree.map(lambda x: x * 0 - 1, t), donate_argnums=0)
    c = ck.Checkpointer(tmp_path / "c", keep=None)
    c.save(1, state)
    state = step(state)
    jax.block_until_ready(state)
    c.close()
    np.testing.assert_array_equal(ck.Checkpointer(tmp_path / "c", read_only=True).read_leaf(1, "w"), big)
    assert float(state["w"][0, 0]) == -1


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("n", [0, 7, 4096, 4096 * 3 + 5, pytest.param((64 << 20) // 4 + 1000, marks=pytest.mark.slow)])
@pytest.mark.parametrize("aligned", [True, False])
def test_direct_io_round_trip_any_size_and_alignment(tmp_path, monkeypatch, direct, n, aligned):
    """Bulk past the page cache, the tail buffered, an unaligned buffer bounced; without
    O_DIRECT (a file system that refuses it) ordinary I/O. CRC-32 = zlib's over the file."""
    from fsdp_jax.checkpoint import direct_io

    if not direct:
        monkeypatch.setattr(direct_io, "_DIRECT", 0)
    src = direct_io.aligned_empty((n + 1,), np.float32)
    src[:] = np.arange(n + 1, dtype=np.float32)
    a = src[:n] if aligned else src[1:]  # offset by 4 bytes: not page-aligned
    crc, pad = direct_io.write_file(tmp_path / "f", a)
    blob = (tmp_path / "f").read_bytes()
    assert blob == bytes(pad) + a.tobytes() and crc == f"{zlib.crc32(blob):08x}"
    assert pad == (0 if not direct or n == 0 else a.ctypes.data % direct_io.ALIGN)
    raw = direct_io.aligned_empty((len(blob),), np.uint8)
    assert direct_io.read_file(tmp_path / "f", raw) == (crc, len(blob))
    np.testing.assert_array_equal(raw[pad:].view(np.float32), a)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("where", ["bulk", "tail"])
def test_a_flipped_byte_in_a_large_file_is_a_shard_file_error(tmp_path, monkeypatch, direct, where):
    """A file over a page: its bulk is read past the page cache (O_DIRECT), its tail through
    an ordinary descriptor; one changed byte in either is caught by the CRC-32 on read."""
    from fsdp_jax.checkpoint import direct_io

    if not direct:
        monkeypatch.setattr(direct_io, "_DIRECT", 0)
    w = np.arange(8 * 3000, dtype=np.float32).reshape(8 * 1000, 3)  # 12000 bytes a shard
    sf.write_shards(tmp_path, *sf.host_shards({"w": jax.device_put(w, NamedSharding(mesh(8), P("fsdp")))}))
    t = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh(2), P("fsdp")))}
    np.testing.assert_array_equal(np.asarray(sf.read_tree(tmp_path, t)["w"]), w)
    e = sf.read_index(tmp_path)["w"]["files"][5]
    f = tmp_path / e["file"]
    blob = bytearray(f.read_bytes())
    at = 2 * direct_io.ALIGN + 7 if where == "bulk" else len(blob) - 3
    blob[at] ^= 0x01
    f.write_bytes(bytes(blob))
    with pytest.raises(ShardFileError, match=rf"^{tmp_path.name}/{e['file']} has changed since it was saved"):
        sf.read_tree(tmp_path, t)


def test_the_checksum_is_zlibs_crc32_computed_by_zlib_ng(tmp_path):
    """Files written before the faster CRC (zlib's own) verify unchanged: the same values,
    whole or chained over pieces."""
    import zlib

    from fsdp_jax.checkpoint import direct_io
    from fsdp_jax.checkpoint.manifest import file_crc32

    assert direct_io._crc32.__module__.startswith("zlib_ng")
    blob = np.random.default_rng(0).integers(0, 256, (1 << 20) + 13, dtype=np.uint8).tobytes()
    assert direct_io.crc32(blob) == zlib.crc32(blob)
    assert direct_io.crc32(blob[777:], direct_io.crc32(blob[:777])) == zlib.crc32(blob)
    assert direct_io.crc32(b"", 0x1234) == zlib.crc32(b"", 0x1234) and direct_io.crc32(b"") == 0
    (tmp_path / "f").write_bytes(blob)
    assert file_crc32(tmp_path / "f", chunk=4096) == f"{zlib.crc32(blob):08x}"


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")
def test_read_buffers_are_private_page_aligned_memory():
    """A restore reads each file into the memory that becomes its array: page-aligned for
    O_DIRECT, and a private mapping (a shared anonymous one is shmem, whose page faults under
    the reads made restores half as fast: BENCHMARKS.md)."""
    from fsdp_jax.checkpoint import direct_io

    a = direct_io.aligned_empty((3, 5000), np.float32)
    addr = a.ctypes.data
    assert addr % direct_io.ALIGN == 0 and a.shape == (3, 5000) and a.flags.c_contiguous
    for line in Path("/proc/self/maps").read_text().splitlines():
        lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
        if lo <= addr < hi:
            assert line.split()[1] == "rw-p", line
            break
    else:
        pytest.fail("the buffer's mapping is not in /proc/self/maps")


@pytest.mark.parametrize("n", [0, 5, 4096, 4096 * 5, 4096 * 5 + 3, 4096 * 6 - 1])
def test_pieces_cover_the_file_in_order_aligned_then_the_tail(monkeypatch, n):
    """PIECE-sized ranges over the aligned bulk (aligned at both ends, so each can go
    direct), the tail under ALIGN bytes last: together exactly [0, n) in order."""
    from fsdp_jax.checkpoint import direct_io

    monkeypatch.setattr(direct_io, "PIECE", 2 * direct_io.ALIGN)
    got = direct_io.pieces(n)
    assert [lo for lo, _ in got] == [0] + [hi for _, hi in got[:-1]] if got else n == 0
    assert (got[-1][1] if got else 0) == n
    bulk = n // direct_io.ALIGN * direct_io.ALIGN
    for lo, hi in got:
        if lo < bulk:
            assert lo % direct_io.ALIGN == 0 and hi % direct_io.ALIGN == 0 and 0 < hi - lo <= direct_io.PIECE
        else:
            assert (lo, hi) == (bulk, n) and hi - lo < direct_io.ALIGN


def test_crc32_combine_is_zlibs_with_or_without_zlib_ng():
    """The file's CRC-32 joined from its pieces' is zlib's over the whole; the fallback
    (zlib alone, no crc32_combine) gives the same values."""
    import zlib

    from fsdp_jax.checkpoint import direct_io

    blob = np.random.default_rng(1).integers(0, 256, 50_000, dtype=np.uint8).tobytes()
    for cut in (0, 1, 4096, 49_999, 50_000):
        a, b = blob[:cut], blob[cut:]
        want = zlib.crc32(blob)
        assert direct_io.crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == want
        assert direct_io._combine_over_zeros(zlib.crc32(a), zlib.crc32(b), len(b)) == want


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("n, n_pieces", [(4096 * 7 + 11, 5), (4096 * 8, 4)])  # 7 pages: 2+2+2+1, tail
@pytest.mark.parametrize("aligned", [True, False])
def test_a_file_read_in_parallel_pieces_is_the_file(tmp_path, monkeypatch, direct, n, n_pieces, aligned):
    """Many pieces of one file read by 4 threads at once, each into its place in the
    destination (an unaligned destination goes through ordinary reads): the bytes and the
    CRC-32 (zlib's over the file, independently) equal the file's, as read piece after piece."""
    import concurrent.futures as cf

    from fsdp_jax.checkpoint import direct_io

    monkeypatch.setattr(direct_io, "PIECE", 2 * direct_io.ALIGN)
    if not direct:
        monkeypatch.setattr(direct_io, "_DIRECT", 0)
    blob = np.random.default_rng(2).integers(0, 256, n, dtype=np.uint8).tobytes()
    (tmp_path / "f").write_bytes(blob)
    raw = direct_io.aligned_empty((n + 1,), np.uint8)
    dst = raw[:n] if aligned else raw[1:]
    with cf.ThreadPoolExecutor(4) as pool:
        parts = [pool.submit(direct_io.read_range, tmp_path / "f", dst, lo, hi) for lo, hi in direct_io.pieces(n)]
        got = direct_io.combine([p.result() for p in parts])
    assert len(parts) == n_pieces
    assert got == (f"{zlib.crc32(blob):08x}", n) and dst.tobytes() == blob
    dst[:] = 0
    assert direct_io.read_file(tmp_path / "f", dst) == got and dst.tobytes() == blob


def _pieced_checkpoint(tmp_path, monkeypatch, direct):
    """A leaf over 8 devices whose shard files (36000 bytes + pad) are 5 or 6 pieces each."""
    from fsdp_jax.checkpoint import direct_io

    monkeypatch.setattr(direct_io, "PIECE", 2 * direct_io.ALIGN)
    if not direct:
        monkeypatch.setattr(direct_io, "_DIRECT", 0)
    w = np.arange(8 * 9000, dtype=np.float32).reshape(8 * 1000, 9)
    sf.write_shards(tmp_path, *sf.host_shards({"w": jax.device_put(w, NamedSharding(mesh(8), P("fsdp")))}))
    t = {"w": jax.ShapeDtypeStruct(w.shape, w.dtype, sharding=NamedSharding(mesh(2), P("fsdp")))}
    return w, t, sf.read_index(tmp_path)["w"]["files"][3]


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("piece", ["first", "middle", "last"])
def test_a_flipped_byte_in_any_piece_is_caught(tmp_path, monkeypatch, direct, piece):
    """Pieces read in parallel restore the exact values; one changed byte in the first, a
    middle or the last (tail) piece of one file fails the file's CRC-32, naming the file."""
    from fsdp_jax.checkpoint import direct_io

    w, t, e = _pieced_checkpoint(tmp_path, monkeypatch, direct)
    np.testing.assert_array_equal(np.asarray(sf.read_tree(tmp_path, t)["w"]), w)
    f = tmp_path / e["file"]
    blob = bytearray(f.read_bytes())
    parts = direct_io.pieces(len(blob))
    assert len(parts) >= 5 and parts[-1][1] - parts[-1][0] < direct_io.ALIGN  # the last: the tail
    lo, hi = parts[{"first": 0, "middle": len(parts) // 2, "last": -1}[piece]]
    blob[(lo + hi) // 2] ^= 0x10
    f.write_bytes(bytes(blob))
    with pytest.raises(ShardFileError, match=rf"^{tmp_path.name}/{e['file']} has changed since it was saved"):
        sf.read_tree(tmp_path, t)


@pytest.mark.parametrize("direct", [True, False])
@pytest.mark.parametrize("keep", [4096 * 3, 4096 * 3 + 100])
def test_a_file_cut_short_under_the_reads_is_a_short_read(tmp_path, monkeypatch, direct, keep):
    """A file truncated after its size was checked (mid-piece, at an aligned and an
    unaligned length) reads short: a ShardFileError naming it, no EINVAL from a direct read
    past the end, no array."""
    from fsdp_jax.checkpoint import direct_io

    w, t, e = _pieced_checkpoint(tmp_path, monkeypatch, direct)
    real = direct_io.read_range
    cut = []

    def read_range(path, a, lo, hi):
        if path.name == e["file"] and not cut:
            cut.append(os.truncate(path, keep))
        return real(path, a, lo, hi)

    monkeypatch.setattr(direct_io, "read_range", read_range)
    with pytest.raises(ShardFileError, match=rf"^{tmp_path.name}/{e['file']} has changed .*CRC-32 short read"):
        sf.read_tree(tmp_path, t)
    assert cut
